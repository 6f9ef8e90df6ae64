"""GPU probe for the capture lifecycle (one rank): rollback, contracts, teardown, stale graphs.

Run by tests/functional/test_capture_lifecycle.py through the multi-rank launcher:
    python lifecycle_probe.py --scenario SCENARIO --out result.json
with SCENARIO one of lifecycle, stale-unchecked, stale-checked, stale-before, stale-garbage.
A tiny megatron-core GPT with TE layers, captured with the plugin's helper (Megatron's own
TECudaGraphHelper underneath), compared with an eager run of the same steps.
"""

import argparse
import gc
import json
import os
import statistics
import time
import traceback
import weakref

import torch

S, B, V, H = 256, 2, 1024, 256


def setup():
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    parallel_state.initialize_model_parallel(1, 1)
    init_num_microbatches_calculator(0, None, B, B, 1)


def build(graphs: bool, fp8: str | None = None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(123, te_rng_tracker=True, use_cudagraphable_rng=True, force_reset_rng=True)
    torch.manual_seed(123)
    extra = dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=[]) if graphs else {}
    if fp8 is not None:  # hybrid format; "delayed" or "tensorwise" (current) scaling
        extra.update(fp8="hybrid", fp8_recipe=fp8, fp8_amax_history_len=16, fp8_amax_compute_algo="max")
    config = TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=4,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_te_rng_tracker=True,
        deterministic_mode=True,
        **extra,
    )
    model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=V, max_sequence_length=S).cuda()
    wrapped = Float16Module(config, model)
    wrapped.zero_grad_buffer = lambda: None  # no DDP in this probe; Megatron's helper calls it
    return config, wrapped


def batches(steps: int, seq: int = S):
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(steps):
        tokens = torch.randint(0, V, (B, seq), device="cuda", generator=gen)
        yield tokens, torch.arange(seq, device="cuda").unsqueeze(0).expand(B, seq)


class Trainer:
    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(self, tokens, positions, keep_graph=False):
        self.opt.zero_grad(set_to_none=False)  # at the start, as Megatron's loop does
        # As Megatron's schedule does before each step's first microbatch: TE's FP8 weight cache is
        # refreshed then (without it, FP8 weights quantized once at the first forward are reused).
        self.model.set_is_first_microbatch()
        loss = self.model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        self.opt.step()
        value = loss.item()
        return (value, loss) if keep_graph else (value, None)


def helper_for(config, model, plugin_config):
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    from megatron_cg_plugin.capture_lifecycle import bind_helper_class
    from megatron_cg_plugin.session import RunSession

    session = RunSession(plugin_config)
    return session, bind_helper_class(TECudaGraphHelper, session)([model], config, S, B)


def static_inputs_alive(helper) -> bool:
    from megatron_cg_plugin.capture.contracts import StaticInput

    statics = [
        value
        for layer in helper.flattened_callables
        for wrapper in layer.cuda_graphs
        for _, value in wrapper.contract.inputs
        if isinstance(value, StaticInput)
    ]
    return bool(statics) and all(static.alive for static in statics)


def lifecycle(result):
    from megatron_cg_plugin.capture.contracts import ContractViolation
    from megatron_cg_plugin.config import PluginConfig

    steps = 8
    _, eager_model = build(graphs=False)
    trainer = Trainer(eager_model)
    eager = [trainer.step(*batch)[0] for batch in batches(steps)]
    del trainer, eager_model
    gc.collect()
    torch.cuda.empty_cache()

    config, model = build(graphs=True)
    trainer = Trainer(model)
    session, helper = helper_for(config, model, PluginConfig())
    graphed, data = [], list(batches(steps))
    for index, batch in enumerate(data):
        if index == 2:
            helper.create_cudagraphs()
            result["first_capture_pool_bytes"] = helper.capture_stats.pool_bytes
            # Contracts hold TE's static buffers weakly: right after capture, and after training on,
            # every one must still be alive (else the layout and alias checks would go unchecked).
            result["static_inputs_alive_after_capture"] = static_inputs_alive(helper)
        if index == 5:
            result["static_inputs_alive_after_replays"] = static_inputs_alive(helper)
        if index == 6:  # teardown, then capture again
            allocated_before_delete = torch.cuda.memory_allocated()
            helper.delete_cuda_graphs()
            stats = helper.teardown_stats
            result["teardown"] = {
                "allocated_delta_bytes": stats.allocated_delta_bytes,
                "pool_bytes_left": stats.pool_bytes_left,
                "pinned_host_delta_bytes": stats.pinned_host_delta_bytes,
                "allocated_before_delete_mib": allocated_before_delete / 2**20,
                "allocated_after_delete_mib": torch.cuda.memory_allocated() / 2**20,
            }
            helper.delete_cuda_graphs()  # a second call is harmless
            helper.create_cudagraphs()
            result["recaptured"] = helper.graphs_created()
        graphed.append(trainer.step(*batch)[0])
    result["eager_losses"], result["graphed_losses"] = eager, graphed
    result["losses_equal"] = eager == graphed
    result["replays"] = helper.capture_stats.replays.total

    # Replay contracts: a shorter sequence, then fp32 hidden states (embedding made fp32).
    violations = {}
    tokens, positions = next(batches(1, seq=S // 2))
    try:
        model(tokens, positions, None, labels=tokens)
    except ContractViolation as error:
        violations["seq_length"] = {"field": error.field, "message": str(error)}
    embedding = model.module.embedding.word_embeddings
    saved = embedding.weight.data
    embedding.weight.data = saved.float()
    tokens, positions = next(batches(1))
    try:
        model(tokens, positions, None, labels=tokens)
    except ContractViolation as error:
        violations["dtype"] = {"field": error.field, "message": str(error)}
    embedding.weight.data = saved
    result["violations"] = violations
    result["rejected"] = helper.capture_stats.replays.total_rejected

    # Host cost of the contract check per replay, on real replay arguments, vs step time.
    layer = helper.flattened_callables[0]
    seen = {}
    wrapper = layer.cuda_graphs[0]
    original_contract = wrapper.contract

    class Spy:  # the wrapper's contract, keeping the last call it checked
        def check(self, args, kwargs, mode):
            seen["call"] = (args, kwargs)
            return original_contract.check(args, kwargs, mode)

    wrapper.contract = Spy()
    step_times = []
    for batch in batches(30):
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.step(*batch)
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - start)
    wrapper.contract = original_contract
    args, kwargs = seen["call"]
    from megatron_cg_plugin.capture.contracts import ReplayContract
    from megatron_cg_plugin.config import ContractCheck

    per_replay = {}
    for mode in (ContractCheck.FULL, ContractCheck.SHAPES):
        contract = ReplayContract.record("probe", args, kwargs, module=layer)
        start = time.perf_counter()
        for _ in range(2000):
            contract.check(args, kwargs, mode=mode)
        per_replay[mode.value] = (time.perf_counter() - start) / 2000
    replays_per_step = len(helper.flattened_callables)  # one microbatch per step, each layer once
    step = statistics.median(step_times[5:])
    result["overhead"] = {
        "step_ms": 1e3 * step,
        "replays_per_step": replays_per_step,
        "check_us_per_replay": {mode: 1e6 * t for mode, t in per_replay.items()},
        "full_check_fraction_of_step": replays_per_step * per_replay["full"] / step,
    }
    helper.delete_cuda_graphs()


def stale(result, check: str, held_by: str = "local"):
    """An eager step's graph kept alive at capture: by a local variable (``loss``), or by garbage
    (a reference cycle, with automatic collection off so that it lives until the plugin collects)."""
    from megatron_cg_plugin.config import PluginConfig

    data = list(batches(4))
    _, eager_model = build(graphs=False)
    reference = Trainer(eager_model)
    result["eager_losses"] = [reference.step(*batch)[0] for batch in data]
    del reference, eager_model

    config, model = build(graphs=True)
    trainer = Trainer(model)
    losses = [trainer.step(*data[0])[0]]
    value, loss = trainer.step(*data[1], keep_graph=True)  # an eager graph left alive: the trap
    losses.append(value)
    session, helper = helper_for(config, model, PluginConfig(stale_graph_check=check, on_capture_error="raise"))
    held = weakref.ref(loss)
    if held_by == "garbage":
        cycle = {"loss": loss}
        cycle["me"] = cycle
        del loss, cycle
        gc.disable()
    result["graph_alive_at_capture"] = held() is not None
    try:
        helper.create_cudagraphs()
        result["captured"] = True
    except Exception as error:  # noqa: BLE001 - the probe reports whatever happened
        result["captured"] = False
        result["error_type"] = type(error).__name__
        result["error"] = str(error)
        result["cause"] = repr(error.__cause__) if error.__cause__ else None
    finally:
        gc.enable()
    result["graph_alive_after_capture"] = held() is not None
    result["graphs_created"] = helper.graphs_created()
    stats = helper.capture_stats
    result["capture_phases"] = None if stats is None else stats.phases
    from megatron.core.transformer import cuda_graphs

    result["megatron_capture_flag_after"] = cuda_graphs.is_graph_capturing()
    if held_by == "local":
        del loss
    # Training should go on, graphed or eagerly, after a capture, a refusal or a rollback.
    try:
        losses += [trainer.step(*batch)[0] for batch in data[2:]]
    except Exception as error:  # noqa: BLE001 - reported for the test to show
        result["eager_step_error"] = f"{type(error).__name__}: {error}"
    result["replays"] = None if stats is None else stats.replays.total
    result["losses"] = losses
    result["losses_equal_eager"] = losses == result["eager_losses"]


def fp8_state(model) -> dict:
    """Every FP8 tensor TE keeps between steps: each module's delayed-scaling meta (scales, amax
    histories) and the global buffers the amax reduction reads, cloned."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    state = {}
    for name, module in model.named_modules():
        for key, meta in getattr(module, "fp8_meta", {}).items():
            for field in ("scale", "amax_history"):
                if isinstance(getattr(meta, field, None), torch.Tensor):
                    state[f"{name}.{key}.{field}"] = getattr(meta, field).clone()
    for buffer in ("global_amax_buffer", "global_amax_history_buffer", "global_scale_buffer"):
        for key, tensors in getattr(FP8GlobalStateManager.quantization_state, buffer).items():
            state[f"{buffer}[{key}]"] = [t.clone() for t in tensors]
    return state


def same_state(before: dict, after: dict) -> list[str]:
    """Names whose tensors differ (or exist on one side only)."""

    def equal(a, b):
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)

    return sorted(
        name
        for name in before.keys() | after.keys()
        if name not in before or name not in after or not equal(before[name], after[name])
    )


def fp8_failure(result, recipe: str, restore_fp8_meta: bool = True):
    """A failure injected inside an FP8 capture (layer 2, after TE's warmup of both layers and
    layer 1's capture): the FP8 state is as before, and eager training goes on equal to a run
    that never captured. ``restore_fp8_meta=False`` drops the transaction's FP8 meta restorable
    (the guard under test), which must show as changed state."""
    from megatron_cg_plugin.capture import te_backend
    from megatron_cg_plugin.capture.transaction import Restorable
    from megatron_cg_plugin.config import PluginConfig

    if not restore_fp8_meta:
        te_backend._fp8_meta_tensors = lambda *args: Restorable("nothing", lambda: None, lambda saved: None)

    data = list(batches(6))
    _, eager_model = build(graphs=False, fp8=recipe)
    reference = Trainer(eager_model)
    result["eager_losses"] = [reference.step(*batch)[0] for batch in data]
    del reference, eager_model

    config, model = build(graphs=True, fp8=recipe)
    trainer = Trainer(model)
    losses = [trainer.step(*batch)[0] for batch in data[:2]]
    before = fp8_state(model)
    session, helper = helper_for(config, model, PluginConfig(inject_capture_failure=2, on_capture_error="eager"))
    helper.create_cudagraphs()
    result["failure"] = helper.capture_stats.failure
    result["graphs_created"] = helper.graphs_created()
    result["fp8_tensors_compared"] = len(before)
    result["fp8_state_changed"] = same_state(before, fp8_state(model))
    losses += [trainer.step(*batch)[0] for batch in data[2:]]
    result["losses"] = losses
    result["losses_equal_eager"] = losses == result["eager_losses"]


SCENARIOS = {  # name -> (--cg-stale-graph-check, what holds the eager graph)
    "stale-unchecked": ("off", "local"),
    "stale-checked": ("refuse", "local"),
    "stale-before": ("before", "local"),
    "stale-garbage": ("refuse", "garbage"),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--scenario",
        required=True,
        choices=[
            "lifecycle",
            "fp8-failure-delayed",
            "fp8-failure-tensorwise",
            "fp8-failure-delayed-unrestored",
            *SCENARIOS,
        ],
    )
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    setup()
    result = {"scenario": options.scenario}
    try:
        if options.scenario == "lifecycle":
            lifecycle(result)
        elif options.scenario.startswith("fp8-failure-"):
            recipe, _, unrestored = options.scenario.removeprefix("fp8-failure-").partition("-")
            fp8_failure(result, recipe, restore_fp8_meta=not unrestored)
        else:
            stale(result, *SCENARIOS[options.scenario])
    except Exception:  # noqa: BLE001 - written out for the test to show
        result["probe_error"] = traceback.format_exc()
    with open(options.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps(result, default=str)[:4000])


if __name__ == "__main__":
    main()
