"""GPU probe for dynamic-CP graph banks (2 ranks): two megatron-core TE TransformerLayers under
hybrid context parallelism, banks for CP 1 and 2 in one pool, replayed per microbatch.

Run by tests/functional/test_graph_banks.py through the launcher:
    python banks_probe.py --scenario layers|training|rope|moe|bank-memory --out result.json
``layers``: every microbatch is a fixed-capacity THD pack (packed.layout) of random sequences; CP-1 microbatches are
per rank, CP-2 microbatches span both ranks (the DP x CP group). Outputs, input gradients and
parameter gradients of the graphed run are compared bitwise with an eager run of the same packs.
``training``: a tiny megatron-core GPT (learned absolute positions, banked layers) trains 30 steps
of 4 THD microbatches each (CP sizes 1 and 2, tokens split per sequence across the CP group as
Megatron does), gradients summed over the DP x CP group and normalized per token, Adam; the
per-step loss of the graphed run is compared with the eager run from the same initial weights.
``rope``: RoPE under dynamic CP (see ``rope``). ``moe``: the ``layers`` schedule through two MoE
layers whose MoE block (drop-and-pad, alltoall) is graphed with attention, compared bitwise.
``bank-memory`` (any number of ranks, CP size 1 only): what the banks' pool holds, from the
allocator's trace.
"""

import argparse
import functools
import json
import os
import random
import statistics
import time
import traceback

for name, value in (("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0"), ("NVTE_TORCH_COMPILE", "0"), ("NVTE_FLASH_ATTN", "0")):
    os.environ.setdefault(name, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TOKENS_PER_RANK, MAX_SEQS, H, HEADS = 256, 4, 256, 4
SCHEDULE = [1, 2, 2, 1, 2, 1, 1, 2]  # CP size of each microbatch, the same on both ranks


def setup():
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    single = dist.get_world_size() == 1  # bank-memory only: CP size 1 (hybrid CP needs an even number of ranks)
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=1, hybrid_context_parallel=not single)
    model_parallel_cuda_manual_seed(123, te_rng_tracker=True, use_cudagraphable_rng=True, force_reset_rng=True)
    if single:
        return {1: None}
    return {1: None, 2: parallel_state.get_hybrid_data_context_parallel_groups(group_size=2)}


def layer_config(num_layers, **extra):
    """The probes' TransformerConfig: bf16, deterministic, hybrid CP, TE graphs (banks replay
    through Megatron's TE graph path)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    options = dict(
        num_layers=num_layers,
        hidden_size=H,
        num_attention_heads=HEADS,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_te_rng_tracker=True,
        deterministic_mode=True,
        hybrid_context_parallel=dist.get_world_size() > 1,
        max_seqlen_per_dp_cp_rank=TOKENS_PER_RANK,
        calculate_per_token_loss=True,
        cuda_graph_impl="transformer_engine",
    )
    return TransformerConfig(**(options | extra))


# The tiny MoE of the farm (presets.MOE_FLAGS) with drop-and-pad, its MoE block graphed with attention.
MOE_SPEC = dict(num_experts=4, moe_grouped_gemm=True)
MOE_CONFIG = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_token_dispatcher_type="alltoall",
    moe_grouped_gemm=True,
    moe_ffn_hidden_size=512,
    gated_linear_unit=True,
    activation_func=torch.nn.functional.silu,
    add_bias_linear=False,
    moe_expert_capacity_factor=1.5,
    moe_pad_expert_input_to_capacity=True,
    cuda_graph_modules=["attn", "moe"],
)
# Dropless, the scope Megatron-Bridge recommends for it: the graph ends after the dispatcher's preprocess.
DROPLESS_MOE_CONFIG = {
    name: value
    for name, value in MOE_CONFIG.items()
    if name not in ("moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity")
} | dict(cuda_graph_modules=["attn", "moe_router", "moe_preprocess"])


def build(spec_options=None, **config_extra):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_cg_plugin.banks.capture import banked_layer_class
    from megatron_cg_plugin.banks.cp_packs import ensure_dynamic_cp_stream

    ensure_dynamic_cp_stream()  # eager hybrid CP needs it too (Megatron leaves it None at static CP 1)
    torch.manual_seed(1234)  # the same weights on both ranks
    config = layer_config(2, **config_extra)
    spec = get_gpt_layer_with_transformer_engine_spec(**(spec_options or {}))
    spec.module = banked_layer_class(spec.module)
    layers = torch.nn.ModuleList(build_module(spec, config=config, layer_number=i + 1) for i in range(2)).cuda()
    return layers


def packs(groups):
    """Per microbatch: (cp size, group, cu, cu_padded, max_seqlen, hidden, grad) on this rank."""
    from megatron_cg_plugin.banks.cp_packs import packed_seq_params
    from megatron_cg_plugin.packed.layout import fixed_capacity_layout, padded_length

    rank = dist.get_rank()
    result = []
    for index, size in enumerate(SCHEDULE):
        # A CP-2 pack is one pack over both ranks (same layout); CP-1 packs differ per rank.
        rng = random.Random(index * 100 + (0 if size > 1 else rank + 1))
        budget, lengths = size * TOKENS_PER_RANK, []
        while len(lengths) < rng.randint(1, MAX_SEQS):
            length = rng.randint(1, budget)
            if sum(padded_length(n, size) for n in lengths) + padded_length(length, size) > budget:
                break
            lengths.append(length)
        layout = fixed_capacity_layout(lengths or [1], size, TOKENS_PER_RANK, MAX_SEQS)
        gen = torch.Generator(device="cuda").manual_seed(index * 10 + rank)
        hidden = torch.randn(TOKENS_PER_RANK, 1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        grad = torch.randn(TOKENS_PER_RANK, 1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        params = packed_seq_params(
            torch.tensor(layout.cu_seqlens, dtype=torch.int32, device="cuda"),
            torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device="cuda"),
            size,
            groups[size],
            layout.max_seqlen,
        )
        result.append((size, params, hidden, grad, layout.cu_seqlens))
    return result


def step(layers, params_list, pack):
    """Forward and backward of one microbatch through the layers (banked calls replay graphs)."""
    _, params, hidden, grad, _ = pack
    x = hidden.detach().requires_grad_(True)
    out = x
    for layer in layers:
        out, _ = layer(hidden_states=out, attention_mask=None, packed_seq_params=params)
    grads = torch.autograd.grad(out, [x, *params_list], grad)
    return [out.detach().clone()] + [g.clone() for g in grads]


def timed(fn, repeats=10):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])


def step_ms(layers, params_list, data):
    """Median milliseconds of one microbatch per CP size (its first pack of that size)."""
    return {
        size: timed(functools.partial(step, layers, params_list, next(p for p in data if p[0] == size)))
        for size in (1, 2)
    }


def reserved():
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def compare(graphed, eager):
    """Per microbatch: whether every output and gradient is bitwise equal, and the largest difference."""
    exact = [all(torch.equal(a, b) for a, b in zip(g, e)) for g, e in zip(graphed, eager)]
    worst = [max((a.float() - b.float()).abs().max().item() for a, b in zip(g, e)) for g, e in zip(graphed, eager)]
    return exact, worst


def moe(result, groups, config=MOE_CONFIG):
    """MoE layers whose MoE block is graphed with attention (drop-and-pad; or, ``dropless_moe``, a
    dropless MoE whose graph ends after the dispatcher's preprocess): banks for CP 1 and 2 replay the
    schedule bitwise like eager (outputs, input and parameter gradients)."""
    from megatron_cg_plugin.banks.capture import ThdCapacity, capture_banks

    layers = build(MOE_SPEC, **config)
    params_list = [p for p in layers.parameters() if p.requires_grad]
    data = packs(groups)
    eager = [step(layers, params_list, pack) for pack in data]
    eager_ms = step_ms(layers, params_list, data)
    banked = capture_banks(layers, groups, ThdCapacity(TOKENS_PER_RANK, MAX_SEQS), debug=True)
    graphed = [step(layers, params_list, pack) for pack in data]
    exact, worst = compare(graphed, eager)
    graphed_ms = step_ms(layers, params_list, data)
    report = banked.report()
    banked.reset()
    result.update(
        rank=dist.get_rank(),
        schedule=SCHEDULE,
        exact=exact,
        all_exact=all(exact),
        max_abs_diff=worst,
        eager_ms=eager_ms,
        graphed_ms=graphed_ms,
        report=report,
    )


def dropless_moe(result, groups):
    moe(result, groups, DROPLESS_MOE_CONFIG)


def run(result, groups):
    from megatron_cg_plugin.banks.capture import ThdCapacity, capture_banks
    from megatron_cg_plugin.banks.cp_packs import packed_seq_params
    from megatron_cg_plugin.banks.router import BankSelectionError
    from megatron_cg_plugin.packed.layout import ThdCapacityError

    layers = build()
    params_list = [p for p in layers.parameters() if p.requires_grad]
    data = packs(groups)
    capacity = ThdCapacity(TOKENS_PER_RANK, MAX_SEQS)
    eager = [step(layers, params_list, pack) for pack in data]
    eager_ms = step_ms(layers, params_list, data)

    # Pool bytes with one bank, then with two.
    base = reserved()
    one = capture_banks(layers, {1: None}, capacity)
    one_bank_bytes = reserved() - base
    one_report = one.report()
    one.reset()
    del one
    base = reserved()
    banked = capture_banks(layers, groups, capacity, debug=True)
    two_bank_bytes = reserved() - base

    graphed = [step(layers, params_list, pack) for pack in data]
    exact, worst = compare(graphed, eager)
    graphed_ms = step_ms(layers, params_list, data)

    training_report = banked.report()  # before the refusals below add their rejections

    # Fail-closed checks: a look-alike group, an unknown CP size, a pack beyond capacity.
    refusals = {}
    size2 = next(p for p in data if p[0] == 2)
    lookalike = dist.new_group(ranks=[0, 1])
    cases = {
        "lookalike_group": packed_seq_params(
            size2[1].cu_seqlens_q, size2[1].cu_seqlens_q_padded, 2, lookalike, size2[1].max_seqlen_q
        ),
        "unknown_cp_size": packed_seq_params(
            size2[1].cu_seqlens_q, size2[1].cu_seqlens_q_padded, 4, lookalike, size2[1].max_seqlen_q
        ),
        "cu_beyond_capacity": packed_seq_params(
            torch.zeros(MAX_SEQS + 3, dtype=torch.int32, device="cuda"),
            torch.zeros(MAX_SEQS + 3, dtype=torch.int32, device="cuda"),
            1,
            None,
            TOKENS_PER_RANK,
        ),
    }
    for name, params in cases.items():
        try:
            step(layers, params_list, (0, params, size2[2], size2[3], None))
            refusals[name] = "not refused"
        except (BankSelectionError, ThdCapacityError) as error:
            refusals[name] = f"{type(error).__name__}: {error}"
    report = banked.report()
    banked.reset()
    result.update(
        rank=dist.get_rank(),
        schedule=SCHEDULE,
        exact=exact,
        all_exact=all(exact),
        max_abs_diff=worst,
        layouts=[list(p[4]) for p in data],
        eager_ms=eager_ms,
        graphed_ms=graphed_ms,
        one_bank_reserved_bytes=one_bank_bytes,
        two_bank_reserved_bytes=two_bank_bytes,
        one_bank_report=one_report,
        training_report=training_report,
        report=report,
        refusals=refusals,
    )


VOCAB, STEPS, STEP_SCHEDULE = 512, 30, [1, 2, 2, 1]  # CP size of each microbatch of a step


def build_gpt():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.module import Float16Module

    from megatron_cg_plugin.banks.capture import banked_layer_class
    from megatron_cg_plugin.banks.cp_packs import ensure_dynamic_cp_stream

    ensure_dynamic_cp_stream()
    model_parallel_cuda_manual_seed(123, te_rng_tracker=True, use_cudagraphable_rng=True, force_reset_rng=True)
    torch.manual_seed(1234)
    config = layer_config(2, attention_backend=AttnBackend.fused)  # matches NVTE_FLASH_ATTN=0 above
    spec = get_gpt_layer_with_transformer_engine_spec()
    spec.module = banked_layer_class(spec.module)
    model = GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=2 * TOKENS_PER_RANK,
        position_embedding_type="learned_absolute",
    ).cuda()
    return Float16Module(config, model)


def training_batches(groups):
    """Per step, per microbatch: this rank's tokens, labels, loss mask, positions and PackedSeqParams.
    CP-2 packs are the same on both ranks and split per sequence (TE's thd_get_partitioned_indices)."""
    import transformer_engine_torch as tex

    from megatron_cg_plugin.banks.cp_packs import packed_seq_params
    from megatron_cg_plugin.packed.layout import fixed_capacity_layout, padded_length

    rank = dist.get_rank()
    steps = []
    for step_index in range(STEPS):
        microbatches = []
        for index, size in enumerate(STEP_SCHEDULE):
            rng = random.Random(step_index * 1000 + index * 10 + (0 if size > 1 else rank + 1))
            budget, lengths = size * TOKENS_PER_RANK, []
            for _ in range(rng.randint(1, MAX_SEQS)):
                length = rng.randint(8, budget // 2)
                if sum(padded_length(n, size) for n in lengths) + padded_length(length, size) > budget:
                    break
                lengths.append(length)
            layout = fixed_capacity_layout(lengths or [8], size, TOKENS_PER_RANK, MAX_SEQS)
            tokens = torch.zeros(layout.tokens, dtype=torch.long)
            labels = torch.zeros(layout.tokens, dtype=torch.long)
            loss_mask = torch.zeros(layout.tokens, dtype=torch.float)
            positions = torch.zeros(layout.tokens, dtype=torch.long)
            for seq, length in enumerate(lengths):
                start = layout.cu_seqlens_padded[seq]
                text = torch.tensor([rng.randrange(VOCAB) for _ in range(length + 1)])
                tokens[start : start + length] = text[:-1]
                labels[start : start + length] = text[1:]
                loss_mask[start : start + length] = 1.0
                positions[start : start + length] = torch.arange(length)
            cu = torch.tensor(layout.cu_seqlens, dtype=torch.int32, device="cuda")
            cu_padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device="cuda")
            local = [t.cuda() for t in (tokens, labels, loss_mask, positions)]
            if size > 1:
                index_on_rank = tex.thd_get_partitioned_indices(
                    cu_padded, layout.tokens, size, dist.get_rank(groups[size])
                )
                local = [t.index_select(0, index_on_rank) for t in local]
            params = packed_seq_params(cu, cu_padded, size, groups[size], layout.max_seqlen)
            microbatches.append((size, params, *[t.unsqueeze(0) for t in local]))
        steps.append(microbatches)
    return steps


def train(model, steps, on_step=None):
    """Megatron's per-token-loss recipe: each microbatch backpropagates its summed token loss, then
    gradients and token counts are summed over the DP x CP group and gradients divided by the tokens."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    losses, times = [], []
    for index, microbatches in enumerate(steps):
        if on_step is not None:
            on_step(index)
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        loss_sum = torch.zeros((), device="cuda")
        tokens = torch.zeros((), device="cuda")
        for _size, packed, input_ids, labels, loss_mask, positions in microbatches:
            per_token = model(input_ids, positions, None, labels=labels, packed_seq_params=packed)
            loss = (per_token.float() * loss_mask).sum()
            loss.backward()
            loss_sum += loss.detach()
            tokens += loss_mask.sum()
        for p in params:
            dist.all_reduce(p.grad)
        totals = torch.stack([loss_sum, tokens])
        dist.all_reduce(totals)
        for p in params:
            p.grad.div_(totals[1])
        optimizer.step()
        losses.append((totals[0] / totals[1]).item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return losses, times


def training(result, groups):
    from megatron_cg_plugin.banks.capture import ThdCapacity, capture_banks

    steps = training_batches(groups)
    eager_losses, eager_times = train(build_gpt(), steps)
    model = build_gpt()
    layers = list(model.module.decoder.layers)
    banks = capture_banks(layers, groups, ThdCapacity(TOKENS_PER_RANK, MAX_SEQS))
    graphed_losses, graphed_times = train(model, steps)
    report = banks.report()
    banks.reset()
    result.update(
        rank=dist.get_rank(),
        steps=STEPS,
        microbatch_cp_sizes=STEP_SCHEDULE,
        eager_losses=eager_losses,
        graphed_losses=graphed_losses,
        losses_equal=eager_losses == graphed_losses,
        eager_step_ms=1e3 * statistics.median(eager_times[3:]),
        graphed_step_ms=1e3 * statistics.median(graphed_times[3:]),
        report=report,
    )


ROPE_LENGTH = 200  # one sequence, shorter than a rank's share so CP 1 and CP 2 can both hold it


def rope_layer():
    """One TE TransformerLayer with fused RoPE, with the plugin's attention (RoPE with the
    microbatch's CP group) and the banked layer class swapped in."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.spec_utils import build_module

    from megatron_cg_plugin.banks.cp_packs import ensure_dynamic_cp_stream
    from megatron_cg_plugin.banks.dynamic_cp import adapt_layer_spec

    ensure_dynamic_cp_stream()
    torch.manual_seed(1234)
    config = layer_config(1, apply_rope_fusion=True, attention_backend=AttnBackend.fused)
    spec = adapt_layer_spec(get_gpt_layer_with_transformer_engine_spec(), rope=True, banks=True)
    return build_module(spec, config=config, layer_number=1).cuda()


def rope_pack(size, groups, sequence, rotary):
    """The sequence alone in a fixed-capacity pack of CP size ``size``: this rank's hidden states,
    the token indices they hold in the pack, the PackedSeqParams and the model's RoPE table."""
    import transformer_engine_torch as tex

    from megatron_cg_plugin.banks.cp_packs import packed_seq_params
    from megatron_cg_plugin.packed.layout import fixed_capacity_layout

    layout = fixed_capacity_layout([ROPE_LENGTH], size, TOKENS_PER_RANK, MAX_SEQS)
    full = torch.zeros(layout.tokens, 1, H, device="cuda", dtype=torch.bfloat16)
    full[:ROPE_LENGTH] = sequence
    cu = torch.tensor(layout.cu_seqlens, dtype=torch.int32, device="cuda")
    cu_padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int32, device="cuda")
    if size > 1:
        index = tex.thd_get_partitioned_indices(cu_padded, layout.tokens, size, dist.get_rank(groups[size]))
    else:
        index = torch.arange(layout.tokens, device="cuda")
    params = packed_seq_params(cu, cu_padded, size, groups[size], layout.max_seqlen)
    table = rotary(layout.max_seqlen, packed_seq=True, cp_group=groups[size])  # what GPTModel passes
    return full.index_select(0, index), index, params, table


def in_sequence_order(local, index, size, groups):
    """This rank's rows of a pack (``index``: their places in the pack), gathered over the CP group
    and put back in pack order; the sequence's rows only."""
    if size == 1:
        return local[:ROPE_LENGTH].clone()
    parts = [torch.empty_like(local) for _ in range(size)]
    places = [torch.empty_like(index) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=groups[size])
    dist.all_gather(places, index, group=groups[size])
    full = torch.empty((size * TOKENS_PER_RANK, *local.shape[1:]), device="cuda", dtype=local.dtype)
    for part, where in zip(parts, places):
        full[where] = part
    return full[:ROPE_LENGTH].clone()


def rope_forward(layer, size, groups, sequence, rotary, grad_seed=5):
    """Forward and backward of the pack; returns the outputs of the sequence's tokens in sequence
    order (gathered over the CP group), the input gradient and the parameter gradients, and (eager
    calls) the queries, keys and values core attention received, in sequence order."""
    hidden, index, params, table = rope_pack(size, groups, sequence, rotary)
    rotated = {}

    def keep_query_key_value(_module, args):
        for name, tensor in zip(("query", "key", "value"), args):
            rotated[name] = tensor.detach().clone()

    hook = layer.self_attention.core_attention.register_forward_pre_hook(keep_query_key_value)
    try:
        x = hidden.detach().requires_grad_(True)
        out, _ = layer(hidden_states=x, attention_mask=None, packed_seq_params=params, rotary_pos_emb=table)
    finally:
        hook.remove()
    grad = torch.randn(
        out.shape, device="cuda", dtype=out.dtype, generator=torch.Generator(device="cuda").manual_seed(grad_seed)
    )
    weights = [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [x, *weights], grad)
    outputs = [in_sequence_order(out.detach(), index, size, groups)] + [g.clone() for g in grads]
    return outputs, {name: in_sequence_order(t, index, size, groups) for name, t in rotated.items()}


def rope(result, groups):
    """RoPE under dynamic CP: a sequence run with CP 2 must reach core attention with the queries
    and keys of the same sequence run with CP 1; and graph banks captured with the RoPE tables
    replay bitwise like eager."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_cg_plugin.banks.capture import ThdCapacity, capture_banks

    sequence = torch.randn(
        ROPE_LENGTH, 1, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(7)
    )  # the same on both ranks
    rotary = RotaryEmbedding(kv_channels=H // HEADS, rotary_percent=1.0)

    def cp2_vs_cp1(layer):
        """Per tensor core attention receives: max |CP 2 - CP 1| relative to its magnitude. The
        projections are per token, so only a wrong rotation makes queries or keys differ; values
        are not rotated (the control)."""
        cp1 = rope_forward(layer, 1, groups, sequence, rotary)[1]
        cp2 = rope_forward(layer, 2, groups, sequence, rotary)[1]
        return {
            name: ((cp2[name].float() - cp1[name].float()).abs().max() / cp1[name].float().abs().max()).item()
            for name in ("query", "key", "value")
        }

    layer = rope_layer()
    dynamic = cp2_vs_cp1(layer)
    eager = {size: rope_forward(layer, size, groups, sequence, rotary)[0] for size in (1, 2)}
    tables = {size: rotary(size * TOKENS_PER_RANK, packed_seq=True, cp_group=groups[size]) for size in (1, 2)}
    banks = capture_banks([layer], groups, ThdCapacity(TOKENS_PER_RANK, MAX_SEQS), rope_tables=tables)
    # Interleaved CP sizes, as the hybrid-CP schedule hands them out.
    graphed = [(size, rope_forward(layer, size, groups, sequence, rotary)[0]) for size in (2, 1, 2)]
    exact = [[size, all(torch.equal(a, b) for a, b in zip(got, eager[size]))] for size, got in graphed]
    # Megatron's stock attention is not measured here: on a CP-2 pack its RoPE call with the static
    # CP-1 group walks the global sequence bounds over the rank's half of the tokens, out of bounds
    # (an illegal memory access on an H200).
    report = banks.report()
    banks.reset()
    result.update(rank=dist.get_rank(), cp2_vs_cp1_relative=dynamic, graphed_equal_eager=exact, report=report)


def largest_pool_allocations(snapshot, pool, count=8):
    """The largest allocations the capture made in ``pool`` (from the allocator's trace), each
    with the first frames outside torch: what the pool's reserved bytes are for."""
    segments = {
        seg["address"]: seg for seg in snapshot["segments"] if tuple(seg.get("segment_pool_id", (0, 0))) == pool
    }

    def in_pool(address):
        return any(start <= address < start + seg["total_size"] for start, seg in segments.items())

    events = [
        e
        for trace in snapshot.get("device_traces", [])
        for e in trace
        if e["action"] in ("alloc", "segment_alloc") and in_pool(e["addr"])
    ]
    events.sort(key=lambda e: -e["size"])
    return [
        {
            "action": e["action"],
            "mib": e["size"] / 2**20,
            "frames": [
                f"{f['filename'].split('site-packages/')[-1].split('/tmp/site/')[-1]}:{f['line']} {f['name']}"
                for f in e.get("frames", [])
                if f["filename"].endswith(".py") and "/torch/" not in f["filename"]
            ][:6],
        }
        for e in events[:count]
    ]


def bank_memory(result, groups):
    """One GPU, CP size 1: what a banked layer pair's pool holds (dense layers and MoE layers),
    against its arenas and boundary storage."""
    from megatron_cg_plugin.banks.capture import ThdCapacity, capture_banks

    for name, spec, config in (("dense", None, {}), ("moe", MOE_SPEC, MOE_CONFIG)):
        layers = build(spec, **config)
        base = reserved()
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        banked = capture_banks(layers, {1: None}, ThdCapacity(TOKENS_PER_RANK, MAX_SEQS))
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        report = banked.report()
        pools = {
            tuple(seg["segment_pool_id"])
            for seg in snapshot["segments"]
            if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
        }
        result[name] = {
            "reserved_delta_mib": (reserved() - base) / 2**20,
            "pool_mib": report["pool_bytes"] / 2**20,
            "arena_mib": report["arena_bytes"] / 2**20,
            "boundary_mib": report["boundary_bytes"] / 2**20,
            "pools": {
                str(pool): {
                    "segments_mib": [
                        seg["total_size"] / 2**20
                        for seg in snapshot["segments"]
                        if tuple(seg.get("segment_pool_id", (0, 0))) == pool
                    ],
                    "largest_allocations": largest_pool_allocations(snapshot, pool),
                }
                for pool in pools
            },
        }
        banked.reset()
        del banked, layers
    result["rank"] = dist.get_rank()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--scenario", choices=["layers", "training", "rope", "moe", "dropless-moe", "bank-memory"], default="layers"
    )
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    result = {}
    try:
        groups = setup()
        {
            "layers": run,
            "training": training,
            "rope": rope,
            "moe": moe,
            "dropless-moe": dropless_moe,
            "bank-memory": bank_memory,
        }[options.scenario](result, groups)
    except Exception:  # noqa: BLE001 - written out for the test to show
        result["probe_error"] = traceback.format_exc()
    out = options.out.replace(".json", f".rank{dist.get_rank() if dist.is_initialized() else 0}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps(result, default=str)[:3000], flush=True)


if __name__ == "__main__":
    main()
