#!/usr/bin/env bash
# Re-measure the figures in docs/RESULTS.md on this machine (about 40 minutes on 2 cores).
# Nothing else heavy should run meanwhile: ratios come from paired, interleaved runs, but a
# machine that is busy with something else makes every interval wide.
set -euo pipefail
cd "$(dirname "$0")/.."
export COLUMNS=150
mkdir -p docs/results
# plain decode, prefill and verify curve beside llama.cpp (builds the peer if it is missing)
LLAMA_BIN=$(bash ../shared/tools/build_llamacpp.sh | tail -1)
python scripts/bench_vs_llamacpp.py --rounds 3 --reps 2 --curve-rows 16 --llama-bin "$LLAMA_BIN" \
  --json docs/results/vs-llamacpp.json | tee docs/results/vs-llamacpp.txt
tsspec bench -m smollm2-135m --chat -w grounded -w prose --config ngram --config ngram:draft=4 -n 48 --reps 3 \
  --json docs/results/bench-smollm2-135m-native.json | tee docs/results/bench-smollm2-135m-native.txt
# n-gram speculation beside llama.cpp's own, through llama-server, on the same rendered prompts
python scripts/spec_vs_llama_server.py -m smollm2-135m -w grounded --reps 2 --llama-bin "$LLAMA_BIN" \
  --json docs/results/spec-vs-llama-server-smollm2-grounded.json
python scripts/spec_vs_llama_server.py -m smollm2-135m -w prose --reps 2 --llama-bin "$LLAMA_BIN" \
  --json docs/results/spec-vs-llama-server-smollm2-prose.json
python scripts/spec_vs_llama_server.py -m qwen2.5-coder-0.5b -w grounded --reps 1 --llama-bin "$LLAMA_BIN" \
  --json docs/results/spec-vs-llama-server-qwen05-grounded.json
# below: the earlier (pre-native-kernel) sections of RESULTS.md; on today's code they re-measure the
# native kernels, so compare with care
python scripts/bench_plain.py --reps 5 --tokens 64 | tee docs/results/plain.txt
for m in smollm2-135m gemma3-270m; do
  chat=(); [ "$m" = smollm2-135m ] && chat=(--chat)
  tsspec bench -m "$m" "${chat[@]}" -w grounded -w prose --config ngram --config ngram:draft=4 \
    -n 48 --reps 3 --json "docs/results/bench-$m.json" --plot "docs/bench-$m.png" | tee "docs/results/bench-$m.txt"
done
tsspec bench -m qwen2.5-coder-0.5b --chat -w grounded -w prose --config ngram -n 48 --reps 3 \
  --json docs/results/bench-qwen2.5-coder-0.5b.json | tee docs/results/bench-qwen2.5-coder-0.5b.txt
tsspec bench -m qwen2.5-coder-1.5b --chat -w grounded -w code -w prose --config ngram \
  --config draft-model:path=qwen2.5-coder-0.5b,draft=4 -n 48 --reps 2 \
  --json docs/results/bench-qwen2.5-coder-1.5b.json --plot docs/bench-qwen2.5-coder-1.5b.png \
  | tee docs/results/bench-qwen2.5-coder-1.5b.txt
