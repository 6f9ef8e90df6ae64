"""Megatron layers under hybrid (dynamic) context parallelism, eager and graphed alike.

Each packed microbatch of ``--hybrid-context-parallel`` runs with its own CP size and the process
group of that size (``PackedSeqParams.cp_group``). Megatron 0.19.2's attention applies THD RoPE with
its *static* CP group (``attention.py``: ``apply_rotary_pos_emb(..., cp_group=self.pg_collection.cp)``),
so a microbatch running with CP 2 is rotated as if its tokens were a whole CP-1 pack: wrong
positions, in eager and graphed runs alike. ``dynamic_cp_attention_class`` gives the attention the
microbatch's group for the duration of one call; ``hybrid_cp_layer_spec`` injects it (and, with
graph banks, the banked layer class) through the layer spec, so no Megatron class is patched. What
a pack hands Megatron's layers (its ``PackedSeqParams``, TE attention's CP stream) is in
``cp_packs``, below the banks that capture with it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from megatron_cg_plugin import foreign_state
from megatron_cg_plugin.banks.capture import banked_layer_class
from megatron_cg_plugin.compat import check_parameters

__all__ = ["adapt_layer_spec", "dynamic_cp_attention_class", "hybrid_cp_layer_spec", "microbatch_cp_group"]


def microbatch_cp_group(packed_seq_params: Any, static_group: Any) -> Any:
    """The CP group a microbatch's RoPE must use: ``static_group`` unless the microbatch carries its
    own CP size (hybrid CP); a CP-1 microbatch keeps the static group, which must then be size 1."""
    size = getattr(packed_seq_params, "local_cp_size", None)
    if size is None:
        return static_group
    if size == 1:
        if static_group is not None and static_group.size() != 1:
            raise ValueError(
                f"a CP-1 microbatch of hybrid CP cannot apply RoPE with the static CP group of size "
                f"{static_group.size()}: use --context-parallel-size 1 with --hybrid-context-parallel."
            )
        return static_group
    group = packed_seq_params.cp_group
    if group is None or group.size() != size:
        raise ValueError(
            f"the microbatch has local_cp_size {size} but its cp_group has "
            f"{None if group is None else group.size()} ranks; pass "
            f"parallel_state.get_hybrid_data_context_parallel_groups(group_size={size})."
        )
    return group


def dynamic_cp_attention_class(base: type[Any]) -> type:
    """A subclass of Megatron's attention class ``base`` whose RoPE uses the microbatch's CP group.

    Megatron reads the group as ``self.pg_collection.cp`` at each RoPE call; for one forward the
    module holds a copy of its collection with ``cp`` replaced (the shared collection is never
    changed), then gets its own back. A class made here is returned as it is: block specs list one
    layer spec object once per layer."""
    if getattr(base, "dynamic_cp_rope", False):
        return base
    check_parameters(base.forward, ("packed_seq_params", "rotary_pos_emb"), where=f"{base.__name__}.forward")

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        static = self.pg_collection
        group = microbatch_cp_group(kwargs.get("packed_seq_params"), static.cp)
        if group is static.cp:
            return base.forward(self, *args, **kwargs)
        per_call = copy.copy(static)
        per_call.cp = group
        with foreign_state.setting(self, "pg_collection", per_call, change="dynamic-cp-pg-collection"):
            return base.forward(self, *args, **kwargs)

    return type(
        f"DynamicCp{base.__name__}",
        (base,),
        {
            "forward": forward,
            "__module__": __name__,
            "dynamic_cp_rope": True,
            "__doc__": f"{base.__name__} applying THD RoPE with the microbatch's CP group (hybrid CP).",
        },
    )


def _layer_specs(spec: Any) -> list[Any]:
    """The per-layer ``ModuleSpec``s of a layer spec or of a block spec (``layer_specs``)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    specs = getattr(spec, "layer_specs", None)
    specs = [spec] if specs is None else list(specs)
    for layer_spec in specs:
        if not (
            isinstance(layer_spec, ModuleSpec)
            and isinstance(layer_spec.module, type)
            and issubclass(layer_spec.module, TransformerLayer)
        ):
            raise ValueError(
                f"hybrid CP with this plugin supports TransformerLayer specs; this model builds "
                f"{getattr(layer_spec, 'module', layer_spec)!r}: use a GPT or MoE layer spec."
            )
    return specs


def adapt_layer_spec(spec: Any, *, rope: bool, banks: bool) -> Any:
    """A copy of ``spec`` (a layer or block spec) with the dynamic-CP attention (``rope``) and the
    banked layer class (``banks``) swapped in; each swap wraps the class the spec already names."""
    spec = copy.deepcopy(spec)  # specs may share submodule objects with other specs: never edit the caller's
    for layer_spec in _layer_specs(spec):
        attention = getattr(layer_spec.submodules, "self_attention", None)
        if rope and attention is not None and isinstance(getattr(attention, "module", None), type):
            attention.module = dynamic_cp_attention_class(attention.module)
        if banks:
            layer_spec.module = banked_layer_class(layer_spec.module)
    return spec


def hybrid_cp_layer_spec(*, rope: bool, banks: bool) -> Callable[[Any, int | None], Any]:
    """A ``GPTModelConfig.transformer_layer_spec`` callable: Megatron's default spec, adapted."""

    def build(config: Any, vp_stage: int | None = None) -> Any:
        from megatron.training.models.gpt import default_layer_spec

        return adapt_layer_spec(default_layer_spec(config, vp_stage), rope=rope, banks=banks)

    return build
