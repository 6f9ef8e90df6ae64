"""Diagnostic only (s48): log every storage the slot arenas place, in warmup (ArenaSizer) and capture
(ArenaHooks), with the custom Function node whose ctx was being protected, to $DIAG_OUT (jsonl).
Also lets FP8 attention through --cg-slot-capture's call check, to reproduce s47."""
import json
import os

OUT = os.environ.get("DIAG_OUT")
if OUT:
    import torch  # noqa: F401
    from megatron_cg_plugin.capture import slot_backend
    from megatron_cg_plugin.memory import saved_tensors as st

    state = {"node": None, "ctx": False}
    ids = {}

    def log(kind, packer, tensor):
        frame = ids.setdefault(id(packer), len(ids))
        with open(OUT, "a") as f:
            f.write(json.dumps({"kind": kind, "frame": frame, "nbytes": tensor.untyped_storage().nbytes(),
                                "shape": list(tensor.shape), "dtype": str(tensor.dtype),
                                "ctx": state["ctx"], "node": state["node"]}) + "\n")

    sizer_place, hooks_place = st.ArenaSizer._place, st.ArenaHooks._place

    def sizer(self, tensor):
        log("warmup", self, tensor)
        return sizer_place(self, tensor)

    def hooks(self, tensor):
        log("capture", self, tensor)
        return hooks_place(self, tensor)

    st.ArenaSizer._place, st.ArenaHooks._place = sizer, hooks
    nodes = st._custom_function_nodes

    def traced_nodes(outputs):
        state["ctx"] = True
        try:
            for node in nodes(outputs):
                state["node"] = type(node).__name__
                yield node
        finally:
            state["ctx"], state["node"] = False, None

    st._custom_function_nodes = traced_nodes
    check = slot_backend.check_slot_capture_call

    def lenient(callables, sample_args, kwargs):
        recipe = kwargs.get("fp8_recipe")
        if recipe is not None and getattr(recipe, "fp8_dpa", False):
            return None
        return check(callables, sample_args, kwargs)

    slot_backend.check_slot_capture_call = lenient
