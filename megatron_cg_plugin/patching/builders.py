"""What the patches of the ledger (``patching.ledger.PATCHES``) put in place of Megatron's or TE's
attributes: each ``build_*(original, session)`` returns a replacement, and the ledger's entry for
the patch names its builder. These reach up into the helper, the rules and the session.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from megatron_cg_plugin import compat, console, host_stand_ins, refusal, rules
from megatron_cg_plugin.capture.step_marks import StepMarks
from megatron_cg_plugin.capture_lifecycle import bind_helper_class
from megatron_cg_plugin.moe.drop_stats import RouterDropTap
from megatron_cg_plugin.parse_errors import plugin_args_provider
from megatron_cg_plugin.slot_sharing.layout import span_of

__all__ = [
    "build_helper",
    "build_mtp_loss_tap",
    "build_offload_reload_wait",
    "build_plugin_args",
    "build_prebuilt_dataset_helpers",
    "build_strided_weak_ref",
    "build_evaluation_tap",
    "build_train_end_report",
    "build_train_step_timer",
    "build_training_log_tap",
    "build_validate_args_rules",
    "marked_schedule",
]


def build_helper(original: type, session: Any) -> type:
    return bind_helper_class(original, session)


def build_training_log_tap(original: Callable, session: Any) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if not session.times_steps:  # the run records nothing per step (no metrics, no report)
            return result
        bound = signature.bind(*args, **kwargs)
        session.on_training_log(
            iteration=bound.arguments["iteration"],
            loss_dict=bound.arguments["loss_dict"],
            num_zeros_in_grad=bound.arguments.get("num_zeros_in_grad"),
        )
        return result

    return training_log


def build_evaluation_tap(original: Callable, session: Any) -> Callable:
    """Megatron's ``evaluate`` inside the session's ``evaluating`` (graphed layers' calls counted, for this
    evaluation only), its losses handed to the session; Megatron's result returned unchanged."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def evaluate(*args: Any, **kwargs: Any) -> Any:
        with session.evaluating(signature.bind(*args, **kwargs).arguments["model"]):
            result = original(*args, **kwargs)
        total_loss_dict = result[0] if isinstance(result, tuple) and result else None
        if total_loss_dict:  # None where Megatron's time limit ended the evaluation
            session.on_evaluation(total_loss_dict)
        return result

    return evaluate


def build_mtp_loss_tap(original: type[Any], session: Any) -> type:
    """Megatron's MTP logging helper with ``track_mtp_metrics`` tapped: it adds each MTP layer's
    reduced loss of the iteration into ``total_loss_dict`` (``mtp_N loss``); the tap hands the
    iteration's additions to the session, which records them with the iteration's other metrics."""
    track = original.track_mtp_metrics
    compat.check_parameters(
        track,
        ("loss_scale", "iteration", "total_loss_dict"),
        where=f"{original.__module__}.{original.__qualname__}.track_mtp_metrics",
    )
    signature = inspect.signature(track)

    def track_mtp_metrics(*args: Any, **kwargs: Any) -> Any:
        if not session.keeps_values:  # no metrics file: not even the difference runs on the device
            return track(*args, **kwargs)
        totals = signature.bind(*args, **kwargs).arguments.get("total_loss_dict")
        before = {} if totals is None else {name: totals[name] for name in totals if _is_mtp_loss(name)}
        result = track(*args, **kwargs)
        if totals is not None:
            session.on_mtp_losses({name: totals[name] - before.get(name, 0) for name in totals if _is_mtp_loss(name)})
        return result

    return type(
        original.__name__,
        (original,),
        {"track_mtp_metrics": staticmethod(track_mtp_metrics), "__module__": __name__, "__doc__": original.__doc__},
    )


def _is_mtp_loss(name: Any) -> bool:
    return isinstance(name, str) and name.startswith("mtp_") and name.endswith(" loss")


def build_plugin_args(original: Callable, session: Any) -> Callable:
    @functools.wraps(original)
    def add_megatron_arguments(parser: Any) -> Any:
        return plugin_args_provider(original(parser))

    return add_megatron_arguments


def build_validate_args_rules(original: Callable, session: Any) -> Callable:
    @functools.wraps(original)
    def validate_args(args: Any, *rest: Any, **kwargs: Any) -> Any:
        parsed = copy.deepcopy(args)  # the flags as given: Megatron's checks change args (lists too) before one fails
        sizes = rules.early_violations(parsed)  # before Megatron computes from them (a 0 divides, 1e20 exhausts memory)
        if sizes:
            raise refusal.refuse(sizes, environ=os.environ)
        # Megatron prints every argument (about 850 lines) as it validates: held back until the rules pass too, so
        # a refusal is what the terminal shows. The flags are checked as on the GPU host, before the host itself.
        with console.megatron_printout_held():
            with host_stand_ins.host_validation():
                try:
                    result = original(args, *rest, **kwargs)
                except refusal.MEGATRON_REJECTIONS as error:  # Megatron's own checks: one line, not a traceback
                    # The plugin's rules the flags break too, first (as megatron-cg check lists them).
                    raise refusal.refuse_megatron(
                        error, environ=os.environ, plugin=rules.unvalidated_plugin_violations(parsed, env=os.environ)
                    ) from None
                session.check_flags(args, environ=os.environ)
            # The launcher and the bench ask it themselves, once their own flags passed too.
            host = None if session.launcher else refusal.refuse_host(session.settings, environ=os.environ)
            if host is not None:
                raise host
        return result

    return validate_args


_SCHEDULE = "forward_backward_func"  # train_step's argument: Megatron's schedule, one step's microbatches


def build_train_step_timer(original: Callable, session: Any) -> Callable:
    """Marks each iteration's start, and hands ``train_step`` its schedule (``forward_backward_func``)
    entering the session's step marks around each call, for the replay contracts (the bench's
    plugin-recording arm wraps its steps the same way)."""
    names = list(inspect.signature(original).parameters)
    # Where the schedule comes (train() passes it positionally; found once, not bound per call)
    position = names.index(_SCHEDULE) if _SCHEDULE in names else None

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        session.mark_iteration_start()
        if position is not None and len(args) > position and callable(args[position]):
            args = (*args[:position], marked_schedule(args[position], session.step_marks), *args[position + 1 :])
        elif callable(kwargs.get(_SCHEDULE)):
            kwargs = {**kwargs, _SCHEDULE: marked_schedule(kwargs[_SCHEDULE], session.step_marks)}
        return original(*args, **kwargs)

    return train_step


def marked_schedule(schedule: Callable, marks: StepMarks) -> Callable:
    """Megatron's ``forward_backward_func`` entering ``marks`` around each call: the microbatches of
    one step are exactly what it runs (a rerun gets marks of its own), so nothing a wrapped
    ``train_step`` does before or after it counts as inside the step."""

    @functools.wraps(schedule)
    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        with marks:
            return schedule(*args, **kwargs)

    return forward_backward


def build_train_end_report(original: Callable, session: Any) -> Callable:
    @functools.wraps(original)
    def train(*args: Any, **kwargs: Any) -> Any:
        session.ensure_checked()  # a run whose flags Megatron's validate_args did not take (--yaml-cfg)
        tap = RouterDropTap() if session.config.moe_drop_stats else None
        if tap is not None:  # train(forward_step_func, model, ...): the model chunks' routers
            tap.attach(kwargs.get("model", args[1] if len(args) > 1 else ()))

        def finish() -> None:
            if tap is not None:
                session.record_moe_drops(tap.dropped_fraction())
            report = session.finish()
            if session.config.log_to_tensorboard:
                _log_to_tensorboard(report.scalars(), session.last_iteration)

        try:
            try:
                result = original(*args, **kwargs)
            except SystemExit:  # --exit-interval, --exit-duration-in-mins, signals: Megatron's normal exits
                finish()
                raise
            finish()
            return result
        finally:  # a crash too: no hook stays on Megatron's routers
            if tap is not None:
                tap.remove()

    return train


def _log_to_tensorboard(scalars: dict[str, float], iteration: int) -> None:
    """The report's figures into Megatron's TensorBoard writer, which exists on the rank that logs
    (``--tensorboard-dir``; the last rank): at the run's last iteration, flushed before the process ends."""
    from megatron.training.global_vars import get_tensorboard_writer

    writer = get_tensorboard_writer()
    if writer is None:
        return
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, iteration)
    writer.flush()


def build_prebuilt_dataset_helpers(original: Callable, session: Any) -> Callable:
    @functools.wraps(original)
    def compile_helpers() -> None:
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            original()  # a source checkout: let Megatron build the helpers as usual

    return compile_helpers


def build_offload_reload_wait(original: Callable, session: Any) -> Callable:
    """``ChunkOffloadHandler.tensor_pop`` waiting for a still-offloaded tensor's copy to the host
    before Megatron reloads it on the current stream (the ledger says why)."""

    @functools.wraps(original)
    def tensor_pop(self: Any, tensor_tag: Any) -> Any:
        # The stream's own capture state: Megatron's flag is also set in TE's eager warmup passes.
        if not isinstance(tensor_tag, torch.Tensor) and not torch.cuda.is_current_stream_capturing():
            group = self.offload_groups[tensor_tag[0] - 1]
            if isinstance(group._tensors.get(tensor_tag), tuple):  # on the host: Megatron reloads it right here
                group.wait_offload_event(torch.cuda.current_stream())
        return original(self, tensor_tag)

    return tensor_pop


def build_strided_weak_ref(original: Callable, session: Any) -> Callable:
    """TE's ``make_weak_ref`` rebuilds every tensor as row-major from its data pointer and shape.
    Non-contiguous tensors go through it as their flat addressed span (row-major by construction)
    and come back as a view with their own strides; containers are walked here so nested tensors
    get the same treatment; everything else is TE's."""

    @functools.wraps(original)
    def make_weak_ref(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.numel() and not x.is_contiguous():
            return original(span_of(x)).as_strided(tuple(x.shape), tuple(x.stride()))
        if isinstance(x, tuple):
            return tuple(make_weak_ref(item) for item in x)
        if isinstance(x, list):
            return [make_weak_ref(item) for item in x]
        if isinstance(x, dict):
            return {key: make_weak_ref(value) for key, value in x.items()}
        return original(x)

    return make_weak_ref
