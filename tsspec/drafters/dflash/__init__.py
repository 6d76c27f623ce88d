"""DFlash and DFlash2 block drafters (``general.architecture = dflash``), bound to one target.

Files: ``config`` (metadata), ``ops`` (pure functions), ``model`` (weights, passes, KV ring, head
adapter), ``load`` (tensor checks and the trunk match).

A DFlash drafter is a small block-diffusion model. It reads the target's own residuals and proposes
a whole block of tokens in ONE forward pass. It borrows the target's token embedding and LM head
and owns a small sliding KV ring; the target's KV cache is never touched. Three passes:

    PASS A  encoder     feat = concat(residual ENTERING each of dflash.target_layers)   [n, T*D]
                        g    = rmsnorm(fc @ feat, enc.output_norm)                         [n, H]
    PASS B  KV inject   K = rope_neox(rmsnorm_head(attn_k @ g, attn_k_norm)) ; V = attn_v @ g
                        ring[pos % ring_rows] <- K, V   (every layer; no Q, no attention, no FFN)
    PASS C  block draft ids = [anchor, MASK x (B-1)] at positions P..P+B-1 (P = anchor's position)
                        x = embed(ids) (the target's embedding, unscaled)
                        per layer:  a = attn(rmsnorm(x)) ; x += a ; x += ffn(rmsnorm(x))
                          attention: q/k norms per head, NEOX rope, non-causal within the block,
                          keys = ring context (positions < P, present in the ring) + the block,
                          sliding window: a query at q sees a key at p iff |q - p| < window
                        h = rmsnorm(x, output_norm) ; logits = the target's LM head (h[1:])
                        -> B-1 drafts: row i (i >= 1) predicts the token AT position P+i

The ring holds K/V of committed tokens only. It refills from the prompt (``begin``) and from
every commit, and it records which position each row holds, so a gap (an adopted KV prefix the
drafter never saw) simply masks out: drafting after a reused prefix starts with a shorter context.

DFlash2 adds two pieces, each a no-op when its tensors are absent (and switchable off for
attribution with ``TS_DFLASH_CONV=0`` / ``TS_DFLASH_SELECTOR=0``; the weights were trained with
both, so neither switch is a supported way to run a DFlash2 file):

* a grouped dynamic depthwise convolution around every attention and FFN sublayer. One projection
  of the sublayer INPUT u gives ``dyn = conv_proj @ u`` viewed [rows, 2, K, G] (side, tap, group);
  side 0 filters the input, side 1 the sublayer's output. For side s, block row r, channel c:
  ``y[r][c] = sum_t (base[s][t][c] + dyn[r][s][t][c // group_size]) * x[r - t][c]``, with
  ``x[r - t] = 0`` for r < t: the filter never reaches across the block boundary. The filtered
  value REPLACES the input / output (there is no extra residual around it);
* a candidate selector: ``unary, cand = topk(logits, K)`` per block position e (logits after the
  target's logit transform ``dflash.logit_scale`` and ``dflash.final_logit_softcapping``), and
  ``score[e][p][c] = unary[e][c] + < A[pred[e][p]] * (P h_e), B[cand[e][c]] >`` with A/B/P the
  ``selector_predecessor`` / ``selector_successor`` / ``selector_hidden`` weights and
  ``pred[0] = anchor``, ``pred[e] = cand[e-1]``. The draft is a GREEDY WALK over that lattice
  (see ``greedy_walk``): at each position the best candidate given the candidate already chosen
  before it. That is not the maximum-total path (Viterbi); it is what the reference drafter does.

GGUF layout read (llama.cpp's ``dflash`` names; numpy shapes, i.e. GGUF dims reversed):

    metadata  dflash.block_count, dflash.embedding_length, dflash.attention.head_count,
              dflash.attention.head_count_kv (default head_count), dflash.attention.key_length
              (default H / heads), dflash.attention.layer_norm_rms_epsilon (default 1e-6),
              dflash.rope.freq_base (default: the trunk's), dflash.rope.dimension_count (default
              head_dim), dflash.feed_forward_length (optional: the FFN tensors say it),
              dflash.block_size (>= 2), dflash.mask_token_id (or
              tokenizer.ggml.mask_token_id), dflash.target_layers = indices of the layers whose
              ENTERING residual is read (llama.cpp's converter writes HF ``target_layer_ids`` + 1);
              a file with only dflash.target_layer_ids (HF output indices) is read as those + 1.
              Optional: dflash.attention.sliding_window (0/absent: full attention),
              dflash.attention.sliding_window_pattern ([bool] per layer, True = sliding),
              dflash.attention.causal (default false), dflash.conv_kernel_size,
              dflash.conv_group_size, dflash.selector_rank, dflash.selector_top_k,
              dflash.logit_scale (0/absent: 1), dflash.final_logit_softcapping (0/absent: none).
    tensors   fc.weight [H, T*D] ; enc.output_norm.weight [H] ; output_norm.weight [H]
              blk.{i}.attn_norm.weight [H] ; blk.{i}.attn_q.weight [nh*hd, H] ;
              blk.{i}.attn_k.weight / attn_v.weight [nkv*hd, H] ; blk.{i}.attn_output.weight
              [H, nh*hd] ; blk.{i}.attn_q_norm.weight / attn_k_norm.weight [hd] ;
              blk.{i}.ffn_norm.weight [H] ; blk.{i}.ffn_gate.weight / ffn_up.weight [F, H] ;
              blk.{i}.ffn_down.weight [H, F]
    optional  token_embd.weight [V, H] (own embedding) ; output.weight [Vd, H] (own LM head) ;
              d2t [Vd] (draft row -> target token id, for a reduced draft vocabulary)
    DFlash2   blk.{i}.attn_conv_base / ffn_conv_base [2, K, H] (no ``.weight`` suffix) ;
              blk.{i}.attn_conv_proj.weight / ffn_conv_proj.weight [2*K*G, H], G = H / group ;
              selector_predecessor.weight / selector_successor.weight [V, r] ;
              selector_hidden.weight [r, H]

Refused with a reason: DSpark heads (``markov_w1.weight``), attention sinks, a drafter whose
hidden size, target layers or fc width do not fit the trunk it is attached to.
"""

from __future__ import annotations

from .config import ARCH, DFlashConfig, read_config  # noqa: F401
from .load import DFlashDrafter, load  # noqa: F401
from .model import DFlashHead, DFlashModel, KVRing  # noqa: F401
from .ops import greedy_walk, grouped_dynamic_conv, selector_lattice  # noqa: F401
