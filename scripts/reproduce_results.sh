#!/usr/bin/env bash
# Re-measure every figure in docs/RESULTS.md on this machine (about 60 minutes on 2 cores), each
# into the raw file the document cites. Nothing else heavy should run meanwhile: ratios come from
# paired, interleaved runs, but a machine busy with something else makes every interval wide.
#
#   bash scripts/reproduce_results.sh            # everything
#   bash scripts/reproduce_results.sh plain spec # some sections: plain (vs llama.cpp, verify curve),
#                                                #   spec (speculation beside llama.cpp's, per model),
#                                                #   governor (the draft model after issue 11's governor
#                                                #   change), chat (multi-turn: kept cache, n-gram),
#                                                #   distill (a draft head and a block drafter trained for smollm2, benched,
#                                                #     and the block drafter run by llama.cpp's draft-dflash),
#                                                #   distill-qwen (a head for qwen2.5-coder-1.5b on a stated budget, about
#                                                #     75 minutes, benched against the 0.5B draft model; not in the default run),
#                                                #   serve (aggregate tok/s, 1 vs 4 concurrent clients)
#
# Models are pulled into the cache on first use; the peer (llama.cpp b11434) is built by
# ../shared/tools/build_llamacpp.sh if it is missing (about 10 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
export COLUMNS=160
mkdir -p docs/results
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(plain spec governor chat distill serve)
want() { local s; for s in "${sections[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

LLAMA_BIN=$(bash ../shared/tools/build_llamacpp.sh | tail -1)
for m in smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do tsspec pull "$m" >/dev/null; done

if want plain; then
  # plain decode (from an empty cache and at depth 512), prefill and the verify curve beside
  # llama-bench, AB/BA per round
  python scripts/bench_vs_llamacpp.py --rounds 3 --reps 2 --curve-rows 16 --depth 512 --llama-bin "$LLAMA_BIN" \
    --json docs/results/vs-llamacpp.json | tee docs/results/vs-llamacpp.txt
  # smollm2's decode, the closest of the four to llama.cpp's, once more on its own with 6 rounds
  python scripts/bench_vs_llamacpp.py smollm2-135m --rounds 6 --reps 2 --no-prefill --no-curve --llama-bin "$LLAMA_BIN" \
    --json docs/results/vs-llamacpp-smollm2-decode.json | tee docs/results/vs-llamacpp-smollm2-decode.txt
fi

if want spec; then
  # tsspec's speculation and llama.cpp's own (its plain decoding, ngram-simple, ngram-mod, and -md
  # where a drafter exists), all in one rotation on the same prompt ids; 48 tokens, chat template
  peer=(--peer llama.cpp --llama-bin "$LLAMA_BIN")
  tsspec bench -m smollm2-135m --chat -w grounded -w prose --config ngram --config ngram:draft=4 -n 48 --reps 2 \
    "${peer[@]}" --json docs/results/spec-smollm2-135m.json --plot docs/spec-smollm2-135m.png \
    | tee docs/results/spec-smollm2-135m.txt
  tsspec bench -m gemma3-270m -w grounded -w prose --config ngram -n 48 --reps 2 \
    "${peer[@]}" --json docs/results/spec-gemma3-270m.json | tee docs/results/spec-gemma3-270m.txt
  tsspec bench -m qwen2.5-coder-0.5b --chat -w grounded -w prose --config ngram -n 48 --reps 2 \
    "${peer[@]}" --json docs/results/spec-qwen2.5-coder-0.5b.json | tee docs/results/spec-qwen2.5-coder-0.5b.txt
  tsspec bench -m qwen2.5-coder-1.5b --chat -w grounded -w code -w prose --config ngram \
    --config draft-model:path=qwen2.5-coder-0.5b --draft-model qwen2.5-coder-0.5b -n 48 --reps 1 \
    "${peer[@]}" --peer-spec ngram-simple --peer-spec ngram-mod --peer-spec draft \
    --json docs/results/spec-qwen2.5-coder-1.5b.json --plot docs/spec-qwen2.5-coder-1.5b.png \
    | tee docs/results/spec-qwen2.5-coder-1.5b.txt
fi

if want governor; then
  # the draft model (qwen2.5-coder-0.5b for 1.5b) after the lazy, windowed drafter catch-up and the
  # governor's park carried across sequences; tsspec only (llama.cpp's figures are in section spec)
  tsspec bench -m qwen2.5-coder-1.5b --chat -w grounded -w code -w prose --config ngram \
    --config draft-model:path=qwen2.5-coder-0.5b --draft-model qwen2.5-coder-0.5b -n 48 --reps 1 \
    --json docs/results/governor-qwen2.5-coder-1.5b.json | tee docs/results/governor-qwen2.5-coder-1.5b.txt
  # the draft model alone on code and prose, two repetitions per prompt: a narrower interval
  tsspec bench -m qwen2.5-coder-1.5b --chat -w code -w prose \
    --config draft-model:path=qwen2.5-coder-0.5b --draft-model qwen2.5-coder-0.5b -n 48 --reps 2 \
    --json docs/results/governor-reps2-qwen2.5-coder-1.5b.json | tee docs/results/governor-reps2-qwen2.5-coder-1.5b.txt
fi

if want chat; then
  # multi-turn conversations: fresh prefill per turn vs the kept cache vs kept cache + n-gram
  python scripts/bench_chat.py -m qwen2.5-coder-0.5b --rounds 3 --tokens 96 \
    --json docs/results/chat-qwen2.5-coder-0.5b.json | tee docs/results/chat-qwen2.5-coder-0.5b.txt
fi

if want distill; then
  # a draft head and a block drafter trained by the documented default commands (about 30
  # minutes each on 2 cores; the weights stay in the cache, never in the repository), then
  # benched beside n-gram in one rotation
  heads="${TSSPEC_CACHE:-$HOME/.cache/tsspec/models}/../heads"
  head="$heads/smollm2-135m-head.gguf"
  block="$heads/smollm2-135m-block.gguf"
  mkdir -p "$heads"
  rm -f "$head.ckpt" "$block.ckpt"
  tsspec distill -m smollm2-135m -o "$head" 2>&1 | tee docs/results/distill-smollm2-135m.txt
  tsspec distill -m smollm2-135m --kind block -o "$block" 2>&1 | tee docs/results/distill-block-smollm2-135m.txt
  tsspec bench -m smollm2-135m --chat -w code -w prose --config "draft-head:path=$head" \
    --config "block:path=$block" --config ngram \
    -n 64 --reps 2 --json docs/results/distill-bench-smollm2-135m.json | tee docs/results/distill-bench-smollm2-135m.txt
  python scripts/llamacpp_dflash_check.py -m smollm2-135m -d "$block" --llama-bin "$LLAMA_BIN" \
    | tee docs/results/distill-llamacpp-dflash-smollm2-135m.txt
fi

if want distill-qwen; then
  # a draft head for qwen2.5-coder-1.5b on a smaller budget than smollm2's defaults (its trunk
  # forwards cost about 10x): 100k corpus tokens, 12k tokens of its own replies, 3000 steps
  heads="${TSSPEC_CACHE:-$HOME/.cache/tsspec/models}/../heads"
  head15="$heads/qwen2.5-coder-1.5b-head.gguf"
  mkdir -p "$heads"
  rm -f "$head15.ckpt"
  tsspec distill -m qwen2.5-coder-1.5b -o "$head15" --tokens 100000 --answers 12000 --steps 3000 2>&1 \
    | tee docs/results/distill-qwen2.5-coder-1.5b.txt
  tsspec bench -m qwen2.5-coder-1.5b --chat -w code -w prose --config "draft-head:path=$head15" \
    --config draft-model:path=qwen2.5-coder-0.5b --draft-model qwen2.5-coder-0.5b --config ngram \
    -n 64 --reps 1 --json docs/results/distill-bench-qwen2.5-coder-1.5b.json \
    | tee docs/results/distill-bench-qwen2.5-coder-1.5b.txt
fi

if want serve; then
  # one tsspec serve process, 1 vs 4 concurrent clients, paired and interleaved rounds; short
  # (64-token) and longer (192-token) replies, since prefill does not gain from concurrency
  for m in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
    for n in 64 192; do
      python scripts/bench_serve_concurrency.py -m "$m" --clients 4 --rounds 4 --tokens $n \
        --json "docs/results/serve-concurrency-$m-t$n.json" | tee "docs/results/serve-concurrency-$m-t$n.txt"
    done
  done
fi
