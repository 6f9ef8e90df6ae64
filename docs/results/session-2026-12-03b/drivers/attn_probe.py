"""s80: which attention backend TE 2.20.2 picks for a packed (THD) microbatch of 4096 tokens in
deterministic mode, as Megatron hands it (its own documents, max_seqlen their longest) and as the
plugin's fixed layout hands it (--cg-thd-max-seqs entries, zero-length tails, max_seqlen --seq-length),
and whether the layouts give the same bits (forward and the three input gradients)."""
import logging
import os
import sys

import torch
import transformer_engine.pytorch as te

logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(message)s")
torch.manual_seed(0)
lengths = torch.randint(16, 400, (40,))
lengths = lengths[torch.cumsum(lengths, 0) <= 4096]
lengths = torch.cat([lengths, torch.tensor([4096 - int(lengths.sum())])])
real = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0).to(torch.int32)]).cuda()
docs, longest = len(lengths), int(lengths.max())
print(f"documents {docs}, longest {longest}", flush=True)
heads, groups, dim, tokens = 16, 4, 128, 4096
dpa = te.DotProductAttention(heads, dim, num_gqa_groups=groups, attention_dropout=0.0, qkv_format="thd",
                             attn_mask_type="padding_causal").cuda()
q0 = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device="cuda")
k0 = torch.randn(tokens, groups, dim, dtype=torch.bfloat16, device="cuda")
v0 = torch.randn(tokens, groups, dim, dtype=torch.bfloat16, device="cuda")
g0 = torch.randn(tokens, heads * dim, dtype=torch.bfloat16, device="cuda")


def fixed(entries):
    out = torch.full((entries,), tokens, dtype=torch.int32, device="cuda")
    out[: docs + 1] = real
    return out


def run(name, offsets, max_seqlen):
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    torch.cuda.reset_peak_memory_stats()
    try:
        out = dpa(q, k, v, cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=max_seqlen,
                  max_seqlen_kv=max_seqlen)
        out.backward(g0)
    except Exception as error:  # noqa: BLE001 - a probe: say what failed and go on
        print(f"== {name}: {type(error).__name__}: {str(error)[:300]}", flush=True)
        return None
    torch.cuda.synchronize()
    print(f"== {name}: peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", flush=True)
    return [t.detach().clone() for t in (out, q.grad, k.grad, v.grad)]


variants = {"megatron": (real, longest), "fixed33_seq": (fixed(33 if docs <= 32 else docs + 1), 4096),
            "fixed33_longest": (fixed(33 if docs <= 32 else docs + 1), longest), "real_seq": (real, 4096),
            "fixed129_seq": (fixed(129), 4096)}
results = {name: run(name, *spec) for name, spec in variants.items()}
base = results["megatron"]
for name, got in results.items():
    if got is not None and base is not None:
        print(f"{name} == megatron (out, dq, dk, dv):", [bool(torch.equal(a, b)) for a, b in zip(got, base)])
print("env", {k: v for k, v in os.environ.items() if k.startswith("NVTE")})
