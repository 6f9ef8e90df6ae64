"""Every change the plugin makes to Megatron's, TE's and torch's state, in lists, with the reason
each exists; ``docs/patches.md`` is rendered from them (``markdown()``).

- ``PATCHES``: module attributes replaced by ``install()``, each entry with its builder (``build``:
  what replaces the attribute). Each is applied only on the supported megatron-core and TE ranges
  (``compat``; TE patches only where TE is installed), checks the signature it relies on before
  replacing anything, and is reverted by restoring the very object it replaced. ``PatchSet.apply_all``
  is all-or-nothing: if one patch fails, the ones already applied are reverted before the error
  propagates.
- ``LENT``: attributes the plugin sets at run time; ``install()`` saves each one marked ``held``
  (``hold_lent``) and ``uninstall()`` restores it, by identity, with the patches.
- ``SCOPED``: state set only inside a ``with`` block (or for one call, put back in its ``finally``),
  back on exit whatever happens.
- ``PRIVATE_API``: private Megatron, TE and torch functions the plugin calls, checked at
  ``install()`` (present, with the parameters relied on) so a changed release is refused up front.

Every change is made and undone through ``foreign_state``, which sits below everything;
this ledger owns the builders (``patching.builders``), so it sits at the install layer.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from megatron_cg_plugin import compat, foreign_state
from megatron_cg_plugin.packed import graphs as packed_graphs
from megatron_cg_plugin.patching import builders

__all__ = [
    "ForeignState",
    "HELPER_METHODS",
    "LENT",
    "PATCHES",
    "PRIVATE_API",
    "Patch",
    "PatchSet",
    "SCOPED",
    "check_private_api",
    "hold_lent",
    "markdown",
]

_Builder = Callable[[Any, Any], Any]  # (the original attribute, the run's session) -> its replacement

HELPER_METHODS = (
    "create_cudagraphs",
    "cuda_graph_set_manual_hooks",
    "delete_cuda_graphs",
    "capture_finished",
    "graphs_created",
)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced attribute ``module.attribute``; ``attribute`` may be a class's (``Class.method``).

    ``expected_params`` are the parameters of the original that the replacement relies on (for a
    class: of its ``__init__``), and ``expected_methods`` the methods a replaced class must still
    have. What replaces it is what ``build(original, session)`` returns.
    """

    name: str
    module: str
    attribute: str
    reason: str
    build: _Builder = dataclasses.field(kw_only=True)
    expected_params: tuple[str, ...] = ()
    expected_methods: tuple[str, ...] = ()
    needs_te: bool = False  # skipped where Transformer Engine is not installed

    @property
    def where(self) -> str:
        return f"{self.module}.{self.attribute}"

    def locate(self) -> tuple[Any, str]:
        """The object that holds the replaced attribute (the module, or the class it names), and the
        attribute's name there."""
        owner: Any = importlib.import_module(self.module)
        *path, name = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    def check(self, original: Any) -> None:
        target = original.__init__ if inspect.isclass(original) else original
        compat.check_parameters(target, self.expected_params, where=self.where)
        missing = [name for name in self.expected_methods if not callable(getattr(original, name, None))]
        if missing:
            raise compat.SignatureMismatchError(
                f"{self.where} lacks method(s) {', '.join(missing)}; install the supported megatron-core "
                "(see docs/versions.md)."
            )


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="plugin-args",
        build=builders.build_plugin_args,
        module="megatron.training.arguments",
        attribute="add_megatron_arguments",
        reason="parse_args() builds every Megatron parser through this module global (arguments.py l.121), "
        "whatever extra_args_provider the script passes; the wrapper adds the --cg-* flags (once) so any "
        "Megatron script accepts them, and makes the parser's errors one line (parse_errors.shorten).",
        expected_params=("parser",),
    ),
    Patch(
        name="validate-args-rules",
        build=builders.build_validate_args_rules,
        module="megatron.training.arguments",
        attribute="validate_args",
        reason="parse_and_validate_args() calls this module global (arguments.py l.107) before any GPU work; "
        "after Megatron's own checks the wrapper runs the plugin's rules (the list megatron-cg check runs) and "
        "resolves the run's config from the --cg-* flags, stopping a broken run with one line per rule; when "
        "Megatron's own checks refuse the flags first, the rules the flags break are listed before its line.",
        expected_params=("args", "defaults"),
    ),
    Patch(
        name="train-step-timer",
        build=builders.build_train_step_timer,
        module="megatron.training.training",
        attribute="train_step",
        reason="train() calls this module global once per iteration (training.py l.3856); marking the start "
        "there (the host clock only, no device synchronize) times every iteration of any script from its start "
        "to the next one's, as Megatron's interval timer does, for the metrics and the report; and handing "
        "train_step its forward_backward_func entering the session's step marks around each call, so a replay "
        "contract knows the microbatches of one schedule run (under Megatron's DDP it reads parameters and "
        "groups at the layer's first replay in each run only).",
        expected_params=("forward_step_func", "data_iterator", "model", "forward_backward_func"),
    ),
    Patch(
        name="train-end-report",
        build=builders.build_train_end_report,
        module="megatron.training.training",
        attribute="train",
        reason="pretrain() calls this module global (training.py l.1423) and it returns after Megatron tore "
        "its graphs down (l.4100), or exits through sys.exit (--exit-interval, --exit-duration-in-mins, "
        "l.4155); the wrapper then prints the run report on rank 0 and writes the --cg-metrics-out / "
        "--cg-report-out files, so a script needs no call of its own.",
        expected_params=("forward_step_func", "model", "optimizer"),
    ),
    Patch(
        name="helper-swap",
        build=builders.build_helper,
        module="megatron.training.training",
        attribute="TECudaGraphHelper",
        reason="train() constructs the TE graph helper from this module global at call time "
        "(training.py l.3715); swapping it is the only hook that puts the plugin's helper "
        "(diagnostics, replay counters, later banks/slots) into Megatron's own loop.",
        expected_params=("model", "config", "seq_length", "micro_batch_size", "optimizers"),
        expected_methods=HELPER_METHODS,
    ),
    Patch(
        name="training-log-tap",
        build=builders.build_training_log_tap,
        module="megatron.training.training",
        attribute="training_log",
        reason="the per-iteration lm loss (reduced over DP) and num-zeros are only available here; after "
        "Megatron's logger ran unchanged, the tap hands them to the session, which keeps device tensors as "
        "they are and reads them in batches (no per-step synchronize), for golden values and the run report.",
        expected_params=("loss_dict", "iteration", "num_zeros_in_grad"),
    ),
    Patch(
        name="evaluation-tap",
        build=builders.build_evaluation_tap,
        module="megatron.training.training",
        attribute="evaluate",
        reason="evaluate_and_print_results() calls this module global (training.py l.4402) for every evaluation "
        "during training (--eval-interval), and its result holds the validation losses it only prints and "
        "writes to TensorBoard; the tap records them for golden values (as 'lm loss validation', Megatron's "
        "TensorBoard tag) and counts, for this evaluation only, the graphed layers' calls (eager: Megatron "
        "replays a layer's graphs only in training mode) and any replay, for the run report.",
        expected_params=("forward_step_func", "data_iterator", "model"),
    ),
    Patch(
        name="mtp-loss-tap",
        build=builders.build_mtp_loss_tap,
        module="megatron.training.training",
        attribute="MTPLossLoggingHelper",
        reason="training_log() reduces each multi-token-prediction layer's loss in this class's "
        "track_mtp_metrics (imported by name into training.py, l.125) and keeps it only for its own "
        "log line and TensorBoard; the tap records the iteration's mtp_N loss for golden values "
        "(Megatron's METRICS name them) and then returns Megatron's result unchanged.",
        expected_methods=("track_mtp_metrics",),
    ),
    Patch(
        name="prebuilt-dataset-helpers",
        build=builders.build_prebuilt_dataset_helpers,
        module="megatron.core.datasets.utils",
        attribute="compile_helpers",
        reason="initialize_megatron() runs `make` for the dataset C++ helpers on rank 0, but the "
        "megatron-core wheel ships the compiled helpers_cpp and no Makefile, so every run "
        "from the wheel exits; use the shipped module when it imports.",
    ),
    Patch(
        name="strided-weak-ref",
        build=builders.build_strided_weak_ref,
        module="transformer_engine.pytorch.graph",
        attribute="make_weak_ref",
        reason="TE 2.20's make_weak_ref (utils.py l.1050-1088, imported by name into graph.py) rebuilds "
        "tensors from data pointer and shape only, so transposed or expanded static outputs and "
        "gradients come back row-major after make_graphed_callables weak-refs them (buffer reuse "
        "path); the replacement keeps their strides.",
        expected_params=("x",),
        needs_te=True,
    ),
    Patch(
        name="offload-reload-waits-for-its-copy",
        build=builders.build_offload_reload_wait,
        module="megatron.core.pipeline_parallel.fine_grained_activation_offload",
        attribute="ChunkOffloadHandler.tensor_pop",
        reason="Megatron 0.19.2's fine-grained offload reloads a saved tensor that no bulk reload brought back "
        "(every one in its first, warmup iteration, when the last layers' groups are offloaded too) on the compute "
        "stream without waiting for the tensor's device-to-host copy on the d2h stream (tensor_pop l.972-984: "
        "only bulk_reload_group waits for the offload event, l.1045), so the reload can read a pinned buffer not "
        "yet written (runs of a 6.7B model came out with wrong step-1 gradients). The wrapper makes the current "
        "stream wait for the group's offload event before such a reload (unless that stream is capturing).",
        expected_params=("tensor_tag",),
    ),
    Patch(
        name="packed-thd-layout",
        build=packed_graphs.build_thd_layout,
        module="megatron.core.models.gpt.gpt_model",
        attribute="GPTModel.forward",
        reason="with --cg-thd-max-seqs, a training microbatch of packed sequences "
        "(--dataloader-inter-document-masking, --sft) enters the model with cu_seqlens of its own length and "
        "max_seqlen of its longest document (Megatron-LM's pretrain_gpt.py forward_step); the wrapper lays it out at "
        "the fixed capacity graphs are captured for (offsets padded with zero-length sequences, max_seqlen = "
        "--cg-thd-max-seqlen, default --seq-length, a batch beyond the capacity or with a longer document refused "
        "naming the flag) before GPTModel computes its RoPE table from it, so eager and graphed steps compute on one "
        "layout (packed.graphs.fixed_params). Other calls pass through.",
        expected_params=("packed_seq_params",),
    ),
    Patch(
        name="packed-graph-capture",
        build=packed_graphs.build_capture,
        module="megatron.core.transformer.transformer_layer",
        attribute="TransformerLayer._te_cuda_graph_capture",
        reason="a TE graph takes tensor inputs only; with --cg-thd-max-seqs the capture's sample inputs carry a "
        "packed microbatch's offsets as the tensor keyword thd_cu_seqlens, which the wrapper turns back into the "
        "PackedSeqParams of the fixed layout before Megatron's capture callable runs (packed.graphs.build_capture).",
    ),
    Patch(
        name="packed-graph-replay",
        build=packed_graphs.build_replay,
        module="megatron.core.transformer.transformer_layer",
        attribute="TransformerLayer._te_cuda_graph_replay",
        reason="Megatron's replay asserts packed_seq_params is None (transformer_layer.py l.1225) when attention is "
        "graphed; with --cg-thd-max-seqs the wrapper checks a packed microbatch is in the fixed layout and hands its "
        "offsets to the graph as thd_cu_seqlens (TE copies them into the static buffer), then runs Megatron's own "
        "replay (packed.graphs.build_replay). Other calls pass through.",
    ),
)


@dataclasses.dataclass(frozen=True)
class ForeignState:
    """A change that is not an install-time replacement: ``target`` is ``module:attribute.path``;
    ``where`` says which code makes it (and, for ``SCOPED``, which ``with`` block restores it)."""

    name: str
    target: str
    reason: str
    where: str
    expected_params: tuple[str, ...] = ()  # PRIVATE_API: the parameters relied on
    needs_te: bool = False
    calls: tuple[str, ...] = ()  # PRIVATE_API: module globals the function must still call by name
    held: bool = False  # LENT: install() saves the attribute and uninstall() restores it
    # How the change is made where not through foreign_state under this entry's name (change=<name>):
    # a foreign API's own setter or context manager, hooks, or plain writes of per-forward state.
    made_with: str = ""

    def locate(self) -> tuple[Any, str]:
        """The object that holds the attribute ``target`` names, and the attribute's name there."""
        module_name, _, path = self.target.partition(":")
        owner: Any = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        return owner, name

    def resolve(self) -> Any:
        owner, name = self.locate()
        return getattr(owner, name)


LENT: tuple[ForeignState, ...] = (
    ForeignState(
        "dynamic-cp-stream",
        "megatron.core.extensions.transformer_engine:TEDotProductAttention.cp_stream",
        "Megatron creates the side stream TE's CP attention needs only when the static CP size is > 1; hybrid CP "
        "switches CP on per microbatch, so eager and graphed runs need it whatever the static size (TE's P2P "
        "attention fails on None.wait_event without it).",
        "banks.cp_packs.ensure_dynamic_cp_stream",
        needs_te=True,
        held=True,
    ),
    ForeignState(
        "checked-graphs",
        "megatron.core.transformer.transformer_layer:TransformerLayer",
        "Instance attribute cuda_graphs of each graphed layer: once Megatron's create_cudagraphs has handed each layer "
        "its graphs, the list holds the same graphs, each wrapped in CheckedGraph (its replay contract and replay "
        "counter; every other attribute is the graph's). Megatron's replay path calls them, and its "
        "delete_cuda_graphs empties the list as it does its own.",
        "capture_lifecycle.PluginHelperMixin._hold_to_contracts",
        made_with="a plain write, as Megatron's create_cudagraphs makes its own",
    ),
    ForeignState(
        "bank-dispatcher-shapes",
        "megatron.core.transformer.moe.token_dispatcher:MoETokenDispatcher",
        "Instance attributes hidden_shape and hidden_shape_before_permute of an MoE layer's token dispatcher: its "
        "preprocess sets them in Python, so a moe_preprocess graph's replay does not, and the eager rest of the MoE "
        "block reads them after it (Megatron's own path keeps them from its capture; the banks' capture clears "
        "hidden_shape with the dispatcher's other per-forward state). Each graph bank records them at its capture "
        "and sets them before each of its replays, as the preprocess it replays would; every eager forward sets "
        "them anew.",
        "banks.capture.LayerBanks.replay (BankGraph.restore_dispatcher)",
        made_with="plain writes before each bank replay, as the replayed preprocess would make them",
    ),
    ForeignState(
        "moe-dispatcher-scratch",
        "megatron.core.transformer.moe.token_dispatcher:MoETokenDispatcher",
        "Instance attributes an MoE layer's token dispatcher lists in cudagraph_attrs (its per-forward state, which "
        "every forward sets anew before reading it) are set to None: before a capture and after the graphs are "
        "deleted, so neither the last eager step's tensors (with that step's autograd graph) nor the last graph's (in "
        "its pool) outlive their step; and, where a slot-shared or bank graph holds the MoE block, as each captured "
        "forward returns, so they are temporaries of the graph, not blocks left alive in the shared pool "
        "(SlotCoverageError).",
        "capture.scratch.clear: capture_lifecycle.PluginHelperMixin._clear_moe_scratch (before capture, after "
        "delete_cuda_graphs); banks.capture (before the banks' capture, and in each bank's capture call); "
        "slot_sharing.megatron_backend (each slot-shared capture call of a whole MoE block)",
        made_with="plain writes of None, as Megatron's own reset of them",
    ),
)

SCOPED: tuple[ForeignState, ...] = (
    ForeignState(
        "bench-profile-one-thread",
        "torch.autograd:set_multithreading_enabled",
        "megatron-cg bench --bench-profile-dir counts each arm's Python calls per step with cProfile, which sees only "
        "the thread that runs it; autograd's engine runs the backward on device threads unless its multithreading is "
        "off, so it is off for those profiled steps (the timed steps keep it on) and back on after them.",
        "bench.command.python_calls_per_step (the with block of torch.autograd.set_multithreading_enabled(False) "
        "around the profiled steps)",
        made_with="torch's own context manager",
    ),
    ForeignState(
        "bench-train-step",
        "megatron.training.training:train_step",
        "megatron-cg bench measures inside Megatron's own train(), which sets the step up as for training: its "
        "first train_step call runs every block of the bench through the real train_step, then ends the loop: it "
        "sets Megatron's args curr_iteration per step and iteration and train_iters to end the loop, all held from "
        "that first call and back as they were when the run returns.",
        "bench.command.run_in_first_train_step (foreign_state.Changes around the launcher's pretrain() or the "
        "user's script)",
    ),
    ForeignState(
        "bench-arm-graphs",
        "megatron.core.transformer.transformer_layer:TransformerLayer",
        "Instance attributes cuda_graphs and cuda_graph_manual_hooks of each graphed layer: megatron-cg bench "
        "--bench-interleave steps keeps every arm's graphs captured at once and switches the layers between them "
        "per step; an arm set aside leaves the layers empty lists (eager), and a failed capture gives them back.",
        "bench.command.MegatronTrainer.deactivate / activate (foreign_state.Changes.set to park an arm, restore to "
        "bring it back) and its capture transaction",
    ),
    ForeignState(
        "bench-offload-fraction",
        "megatron.core.transformer.transformer_config:TransformerConfig",
        "Instance attribute activation_offload_fraction of the layers' TransformerConfig: a bench arm named -f<P> "
        "captures as --activation-offload-fraction P/100 would, for its own capture only; the run's value is back "
        "after it, whatever happens.",
        "bench.command.MegatronTrainer._offload_fraction (foreign_state.Changes around the arm's capture)",
    ),
    ForeignState(
        "tune-scope",
        "megatron.core.transformer.transformer_config:TransformerConfig",
        "Instance attributes cuda_graph_modules of the model's TransformerConfig objects and cuda_dtoh_point of its "
        "MoE alltoall dispatchers: megatron-cg tune captures setups of different scopes on one model, and Megatron "
        "reads the scope from each layer's config at every capture and replay (the dispatcher's copy point is fixed "
        "when it is built), so each arm sets them as its own build would. When no arm is active (the eager steps) the "
        "configs hold the built model's scope again and the dispatchers an eager build's copy point; the timing "
        "process ends with the tune.",
        "tune.trainer.TuneTrainer._scope (the built scope saved through foreign_state when the trainer is made, put "
        "per arm)",
    ),
    ForeignState(
        "bank-replay-cuda-graphs",
        "megatron.core.transformer.transformer_layer:TransformerLayer",
        "Instance attribute cuda_graphs of a banked layer (the plugin's subclass, injected through the layer spec), "
        "for one bank replay: Megatron's _te_cuda_graph_replay calls self.cuda_graphs[i]; lending it the bank's graph "
        "runs Megatron's own scope post-processing and its delayed offload flush after the bank replay.",
        "banks.capture.LayerBanks.replay (foreign_state.setting around Megatron's _te_cuda_graph_replay)",
    ),
    ForeignState(
        "dynamic-cp-pg-collection",
        "megatron.core.transformer.attention:Attention",
        "Instance attribute pg_collection of a dynamic-CP attention (the plugin's subclass of the layer spec's "
        "attention class), for one forward: Megatron's attention applies THD RoPE with self.pg_collection.cp (the "
        "static group); the module holds a copy with the microbatch's CP group instead, so the shared collection is "
        "never edited.",
        "banks.dynamic_cp.dynamic_cp_attention_class (foreign_state.setting around its forward, only where the "
        "microbatch's CP group is not the static one)",
    ),
    ForeignState(
        "megatron-capture-call",
        "megatron.core.transformer.cuda_graphs:make_graphed_callables",
        "Megatron's own create_cudagraphs runs the capture and hands graph i to its layer and microbatch (the "
        "index arithmetic stays Megatron's); the plugin's capture call stands in for TE's there, so the capture "
        "goes through the plugin's transaction and the graphs it returns can be held to their contracts.",
        "capture_lifecycle.PluginHelperMixin.create_cudagraphs (foreign_state.setting around Megatron's "
        "create_cudagraphs)",
        needs_te=True,
    ),  # Megatron imports it from TE
    ForeignState(
        "layer-capture-tracker",
        "megatron.core.transformer.transformer_layer:TransformerLayer._te_cuda_graph_capture",
        "Set on each graphed layer instance for one capture, wrapping Megatron's method: it names the layer and phase "
        "where a capture failed (the forward, or the backward autograd reaches through a tensor hook on the forward's "
        "outputs: TE captures every forward first, then the backwards in reverse order) and raises the test-only "
        "injected failure (--cg-inject-capture-failure). After the block the instance has its class's method again "
        "and no hook stays on TE's static outputs.",
        "capture_lifecycle._CaptureTracker.installed (foreign_state.setting around Megatron's create_cudagraphs in the "
        "capture transaction, and around the graph banks' capture)",
    ),
    ForeignState(
        "tracked-cuda-graphs",
        "torch:cuda.CUDAGraph",
        "TE creates its graph objects inside make_graphed_callables and drops them on failure; the transaction must "
        "reset every graph created so far, so while TE captures, the class TE looks up on torch.cuda at call time is "
        "a subclass that reports each instance.",
        "capture.te_backend.TEBackend.tracking (foreign_state.setting around TE's make_graphed_callables in the "
        "capture call)",
    ),
    ForeignState(
        "offload-group-names",
        "megatron.core.pipeline_parallel.fine_grained_activation_offload:FineGrainedActivationOffloadingInterface.__enter__",
        "In-graph offload in slot-shared capture: Megatron's offload interface would install its own saved-tensor "
        "hooks, which take the saves away from the slot arenas' hook; inside the capture its __enter__ and __exit__ "
        "only name the group running now and group_offload returns its tensor (the plugin copies the saves itself).",
        "slot_sharing.offload_groups.OffloadGroupTracker.scoped "
        "(foreign_state.setting around slot-shared warmup and capture)",
    ),
    ForeignState(
        "offload-in-graph-flag",
        "megatron.core.transformer.transformer_layer:TransformerLayer",
        "Instance attribute offload_module_in_cuda_graph of each layer slot-shared capture offloads in: set, "
        "Megatron's capture callable records an event on its offload manager's stream and waits on its D2H stream "
        "inside the graph (forward_record / backward_record), streams the capture never forked; the arenas bring their "
        "own copy streams, so it is False during warmup and capture.",
        "slot_sharing.offload_groups.MegatronOffload.capturing "
        "(foreign_state.setting around slot-shared warmup and capture)",
    ),
    ForeignState(
        "moe-router-drop-tap",
        "megatron.core.transformer.moe.router:TopKRouter.forward",
        "--cg-moe-drop-stats measures the fraction of assignments the router drops at a fixed capacity: a forward "
        "hook on each of the run's TopKRouter modules adds its kept and asked assignments to a device counter "
        "(captured along with the graphs that hold the router).",
        "moe.drop_stats.RouterDropTap (forward hooks for the length of train(), removed after it; train-end-report)",
        made_with="torch's module forward hooks",
    ),
    ForeignState(
        "megatron-capture-flag",
        "megatron.core.transformer.cuda_graphs:_IS_GRAPH_CAPTURING",
        "An MoE layer whose graph ends inside the MoE block (moe_router, moe_preprocess) returns after the router or "
        "the dispatcher's preprocess only while Megatron's capture flag is set (moe_utils.maybe_raise_signal), as "
        "Megatron's TECudaGraphHelper sets it around its capture; graph banks capture on their own and set it the "
        "same way for such layers.",
        "banks.capture.megatron_capturing (foreign_state.setting around the banks' warmup and capture)",
    ),
    ForeignState(
        "te-capture-flag",
        "transformer_engine.pytorch.graph:_IS_GRAPH_CAPTURING",
        "TE modules pick graph-safe paths while TE's capture flag is set (cuDNN's graph mode, the CP tail handling "
        "without a device-to-host slice); slot-shared capture runs its own capture and sets it the same way.",
        "capture.te_backend.te_capture_flag (foreign_state.held around slot-shared capture)",
        needs_te=True,
    ),
    ForeignState(
        "slot-capture-generators",
        "transformer_engine.pytorch.distributed:get_all_rng_states",
        "The states of the CUDA generators graphs draw from (torch's default one and TE's graph-safe tracker states "
        "this function returns): slot-shared warmup and capture draw random numbers eager training never draws, and "
        "a replay draws from a generator's live offset, so they are set back to where they were before warmup once "
        "the capture succeeds, as TE's make_graphed_callables does (graph.py 1692-1725); without it every dropout mask "
        "after capture moved and graphed training differed from eager.",
        "capture.te_backend.generators_preserved (with block around slot-shared warmup and capture in capture_slotted)",
        needs_te=True,
        made_with="the generators' own get_state and set_state",
    ),
    ForeignState(
        "slot-fp8-weight-update-flag",
        "transformer_engine.pytorch.quantization:FP8GlobalStateManager.quantization_state.skip_fp8_weight_update_tensor",
        "slot-shared capture with FP8 caches weights as TE's make_graphed_callables does: TE's global weight-update "
        "flag exists from before the first warmup (set to update), so each module quantizes its weight into its "
        "cached workspace under the flag inside the graph; each replay fills it (skip unless Megatron's "
        "is_first_microbatch). The graphs read it by address, so after a successful capture it stays, as TE's "
        "own does; a failed capture puts back what was there.",
        "slot_sharing.fp8_state.Fp8Capture.enter / exit (around warmup and capture in capture_slotted; "
        "Fp8Replay.before_forward fills it)",
        needs_te=True,
        made_with="TE's FP8GlobalStateManager setter (foreign_state.put back after a failed capture)",
    ),
    ForeignState(
        "slot-fp8-replay-amax-group",
        "transformer_engine.pytorch.module.base:TransformerEngineBaseModule.fp8_meta",
        "delayed scaling in slot-shared graphs: before each replay the modules the graph's forward reached take "
        "the replay-time autocast's recipe and amax group in fp8_meta['recipe'] / ['fp8_group'] and join TE's "
        "global amax buffer, as TE's graphed callables do (graph.py new_fwd); it is per-autocast state TE resets.",
        "slot_sharing.fp8_state.Fp8Replay.before_forward (each FP8 replay under an active autocast)",
        needs_te=True,
        made_with="writes into TE's per-autocast fp8_meta, as TE's graphed callables make them",
    ),
    ForeignState(
        "cpu-device-stand-ins",
        "torch:cuda.get_device_capability",
        "megatron-cg check runs Megatron's validation on a CPU machine as on the GPU host: get_device_capability "
        "and get_device_properties describe an sm_90 device there (Megatron asks for grouped GEMM and the TP/CP "
        "connection rules).",
        "host_stand_ins.gpu_host_stand_ins (foreign_state.setting around the dry run, and a run's validation on a host "
        "without a GPU; only where no GPU is present)",
    ),
    ForeignState(
        "te-kernel-stand-ins",
        "megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb",
        "TransformerConfig refuses RoPE and permutation fusion when TE's kernels did not import, as on a CPU "
        "machine; the dry run checks flags for a GPU host that has them, so the fused RoPE and the moe_utils "
        "fused permute/unpermute/sort-chunks symbols (host_stand_ins.TE_KERNELS) are stand-ins that are never called.",
        "host_stand_ins.gpu_host_stand_ins (foreign_state.setting around the dry run, and a run's validation on a host "
        "without a GPU; only where TE did not import)",
    ),
    ForeignState(
        "te-version-stand-in",
        "megatron.core.utils:_te_version",
        "Megatron's config checks gate features on the TE version (moe_act recompute under FP8 needs >= 2.6); "
        "where TE is not installed it reads 0.0.0, so the dry run sets Megatron's cached version to the lowest "
        "TE release the plugin supports, the one the GPU host will have at least.",
        "host_stand_ins.gpu_host_stand_ins (foreign_state.setting around the dry run, and a run's validation on a host "
        "without a GPU; only where TE is not installed)",
    ),
)

PRIVATE_API: tuple[ForeignState, ...] = (
    ForeignState(
        "megatron-create-cudagraphs",
        "megatron.core.transformer.cuda_graphs:TECudaGraphHelper.create_cudagraphs",
        "the plugin runs Megatron's own capture lifecycle with its capture call in place of TE's "
        "(megatron-capture-call): the method must still call the module's make_graphed_callables.",
        "capture_lifecycle.py",
        ("self",),
        calls=("make_graphed_callables",),
    ),
    ForeignState(
        "megatron-sample-arguments",
        "megatron.core.transformer.cuda_graphs:TECudaGraphHelper._get_sample_arguments",
        "with --cg-thd-max-seqs the plugin's helper rewrites the sample arguments Megatron builds per layer "
        "and microbatch as a packed microbatch brings them (packed.graphs.sample_inputs).",
        "capture_lifecycle.py",
        ("self", "order", "chunk_id_list"),
    ),
    ForeignState(
        "megatron-reset-after-capture",
        "megatron.core.transformer.cuda_graphs:TECudaGraphHelper._reset_after_capture",
        "Megatron's own post-capture reset, run after a failed capture is rolled back.",
        "capture_lifecycle.py",
        ("self",),
    ),
    ForeignState(
        "megatron-layer-capture",
        "megatron.core.transformer.transformer_layer:TransformerLayer._te_cuda_graph_capture",
        "the scope-aware callable Megatron captures (banks capture it too; the transaction wraps it per layer).",
        "capture_lifecycle.py, banks/capture.py",
    ),
    ForeignState(
        "megatron-layer-replay",
        "megatron.core.transformer.transformer_layer:TransformerLayer._te_cuda_graph_replay",
        "a bank replay runs Megatron's replay path (scope post-processing, delayed offload flush).",
        "banks/capture.py",
    ),
    ForeignState(
        "megatron-forward-attention",
        "megatron.core.transformer.transformer_layer:TransformerLayer._forward_attention",
        "hybrid CP hands each microbatch's packed sequences and RoPE table to attention.",
        "banks/capture.py",
        ("attention_mask", "rotary_pos_emb", "packed_seq_params"),
    ),
    ForeignState(
        "torch-version-counter",
        "torch:_C._autograd._unsafe_set_version_counter",
        "a tensor unpacked from a saved-tensor arena gets the version the save recorded, so autograd's "
        "in-place check sees what it would have seen without the arena.",
        "slot_sharing/saved_tensors.py",
    ),
    ForeignState(
        "te-graph-autocast",
        "transformer_engine.pytorch.quantization:autocast.__init__",
        "slot-shared capture with FP8 runs warmup and capture under the autocast TE's make_graphed_callables "
        "uses (_graph=True: no global amax buffer, no reduction at exit).",
        "slot_sharing/fp8_state.py",
        ("self", "enabled", "calibrating", "recipe", "amax_reduction_group", "_graph"),
        needs_te=True,
    ),
    ForeignState(
        "te-save-fp8-tensors",
        "transformer_engine.pytorch.graph:save_fp8_tensors",
        "delayed scaling: slot-shared capture clones the amax histories and scales before warmup and copies "
        "them back after capture (restore_fp8_tensors), as make_graphed_callables does.",
        "slot_sharing/fp8_state.py",
        ("modules", "recipe"),
        needs_te=True,
    ),
    ForeignState(
        "te-restore-fp8-tensors",
        "transformer_engine.pytorch.graph:restore_fp8_tensors",
        "copies back what save_fp8_tensors cloned (te-save-fp8-tensors).",
        "slot_sharing/fp8_state.py",
        ("modules", "fp8_tensors"),
        needs_te=True,
    ),
    ForeignState(
        "te-amax-buffer",
        "transformer_engine.pytorch.quantization:FP8GlobalStateManager.add_fp8_tensors_to_global_buffer",
        "a delayed-scaling replay joins its modules to the autocast's amax reduction (slot-fp8-replay-amax-group); "
        "the autocast's first FP8 graph (is_first_fp8_module) runs reduce_and_update_fp8_tensors(forward=False) "
        "after its backward replay.",
        "slot_sharing/fp8_state.py",
        ("fp8_meta",),
        needs_te=True,
    ),
    ForeignState(
        "te-capture-start",
        "transformer_engine.pytorch.graph:set_capture_start",
        "sets TE's capture flag as make_graphed_callables does (te-capture-flag).",
        "capture/te_backend.py",
        needs_te=True,
    ),
)


def markdown() -> str:
    """``docs/patches.md``: every list of this ledger as a table (a unit test holds the page to it)."""
    lines = [
        "# What the plugin changes in Megatron, TE and torch, and why",
        "",
        "Generated from `megatron_cg_plugin/patching/ledger.py` (`python -c 'from megatron_cg_plugin.patching.ledger "
        'import markdown; print(markdown(), end="")\' > docs/patches.md`); edit the ledger, not this page.',
        "Every patch and held attribute, and each change below not marked *made with*, is made and undone",
        "through one primitive, `megatron_cg_plugin/foreign_state.py`, under its entry's name: what is saved is",
        "what the object itself holds, and an attribute it did not hold itself (absent, or only inherited from its",
        "class) is restored by deleting it, so nothing is left behind. A unit test holds the code to it.",
        "",
        "## Replaced by `install()` (`PATCHES`)",
        "",
        "Each entry names its builder, which makes what replaces the attribute. Every patch replaces one module",
        "attribute (or one method of a Megatron class, reverted by restoring the class's own function), is applied",
        "only on the supported megatron-core and TE ranges (TE patches only where TE is installed), checks the",
        "original's signature before replacing it, and is reverted by `uninstall()` by restoring the very object it",
        "replaced. Applying is all-or-nothing.",
        "",
        "| name | attribute | built by | why |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| `{patch.name}` | `{patch.where}` | `{patch.build.__module__.removeprefix('megatron_cg_plugin.')}."
        f"{patch.build.__name__}` | {patch.reason} |"
        for patch in PATCHES
    ]
    sections = (
        (
            "Attributes set at run time (`LENT`)",
            "`install()` saves each attribute marked held as it is then; `uninstall()` puts it back by identity, with "
            "the patches. The others are per-forward state of Megatron's objects, which the next forward sets anew.",
            "set by",
        ),
        (
            "State set inside a `with` block or for one call (`SCOPED`)",
            "Back on exit (of the `with` block, or in the call's `finally`), whatever happens.",
            "block",
        ),
        (
            "Private functions relied on, checked at `install()` (`PRIVATE_API`)",
            "`install()` refuses (`SignatureMismatchError`, nothing patched) where one is missing, lacks the "
            "parameters listed, or no longer calls the function the plugin stands in for. A wrapper found there "
            "(`__wrapped__`, as `functools.wraps` sets it) is checked through to the function it wraps; the error "
            "names the object found and says whether it is the library's own (the build differs) or defined elsewhere "
            "(a wrapper: [troubleshooting.md](troubleshooting.md#signaturemismatcherror)).",
            "used by",
        ),
    )
    for (title, text, where), entries in zip(sections, (LENT, SCOPED, PRIVATE_API), strict=True):
        lines += ["", f"## {title}", "", text, "", f"| name | attribute | {where} | why |", "| --- | --- | --- | --- |"]
        lines += [
            f"| `{entry.name}` | `{entry.target.replace(':', '.')}` | {entry.where}"
            f"{' (held: `uninstall()` restores it)' if entry.held else ''}"
            f"{f'; *made with* {entry.made_with}' if entry.made_with else ''} | {entry.reason} |"
            for entry in entries
        ]
    return "\n".join(lines) + "\n\n## Relied on, not changed\n\n" + _RELIED_ON


# What the plugin reads or checks of Megatron without changing it, beyond PRIVATE_API (each change is an entry above).
_RELIED_ON = """\
A dynamic-CP attention class checks, as the layer spec is adapted, that Megatron's attention `forward` takes
`packed_seq_params` and `rotary_pos_emb` (`SignatureMismatchError` otherwise). Bank replays read Megatron's
delayed offload queue (`PipelineOffloadManager._delayed_offload_groups`, read only) to check and count the
groups flushed after them (`slot_sharing.offload_groups.delayed_offload_groups`).
"""


def hold_lent(changes: foreign_state.Changes, *, with_te: bool) -> None:
    """Saves, in ``changes`` (the install's), each ``LENT`` attribute that uninstall restores, as
    it is before the run lends it (``ForeignState.held``)."""
    for entry in LENT:
        if entry.held and (with_te or not entry.needs_te):
            changes.hold(*entry.locate(), change=entry.name)


def check_private_api(*, with_te: bool) -> None:
    """Raises ``compat.SignatureMismatchError`` naming the first private function that moved."""
    for entry in PRIVATE_API:
        if entry.needs_te and not with_te:
            continue
        try:
            target = entry.resolve()
        except (ImportError, AttributeError) as error:
            raise compat.SignatureMismatchError(
                f"{entry.target} is gone ({error}); the plugin relies on it ({entry.reason}) Install the supported "
                "megatron-core / TE (docs/versions.md)."
            ) from None
        if not callable(target):
            raise compat.SignatureMismatchError(
                f"{entry.target} is no longer callable; install the supported versions."
            )
        if entry.expected_params:  # builtins (torch's C functions) carry no signature to check
            compat.check_parameters(target, entry.expected_params, where=entry.target)
        # A wrapper's own code calls what it wraps: the names are looked for in the function it wraps.
        code = getattr(compat.unwrapped(target), "__code__", None)
        missing = [name for name in entry.calls if code is None or name not in code.co_names]
        if missing:
            raise compat.SignatureMismatchError(
                f"{entry.target} no longer calls {', '.join(missing)}, which the plugin stands in for ({entry.reason}) "
                f"{compat.found_at(target, entry.target)}"
            )


class PatchSet:
    """Applies ``patches`` for one session, each replacement built by the patch's own ``build``,
    and reverts them by identity (``foreign_state.Changes``)."""

    def __init__(self, patches: Sequence[Patch]) -> None:
        unbuilt = [patch.name for patch in patches if not callable(patch.build)]
        if unbuilt:
            raise ValueError(f"each patch needs a builder: none for {unbuilt}.")
        self._patches = tuple(patches)
        self._changes = foreign_state.Changes()

    def apply_all(self, session: Any, *, with_te: bool = True) -> None:
        assert not self._changes, "patches already applied"
        try:
            for patch in self._patches:
                if patch.needs_te and not with_te:
                    continue
                owner, name = patch.locate()
                original = getattr(owner, name)
                patch.check(original)
                replacement = patch.build(original, session)
                self._changes.set(owner, name, replacement, change=patch.name)
        except BaseException:
            self.revert_all()
            raise

    def revert_all(self) -> None:
        self._changes.restore()
