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

# s50: follow FusedAttnFunc's S-scale snapshot from its creation to the coverage check.
if OUT:
    import gc
    import weakref
    from megatron_cg_plugin.capture import hygiene
    from transformer_engine.pytorch.attention.dot_product_attention import backends as te_backends

    created = []  # (weakref to the S copy, scale data_ptr at creation, frame counter)

    def note(row):
        with open(OUT, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    forward_impl = te_backends._fused_attn_forward_impl

    def traced_forward_impl(args):
        result = forward_impl(args)
        s = result[3].get("S_quantizer")
        if s is not None and getattr(s, "scale", None) is not None:
            created.append((weakref.ref(s), s.scale.data_ptr(), id(s)))
            note({"kind": "s_copy", "id": id(s), "ptr": s.scale.data_ptr(), "shape": list(s.scale.shape),
                  "capturing": torch.cuda.is_current_stream_capturing(), "fp8": result[3].get("fp8")})
        return result

    te_backends._fused_attn_forward_impl = traced_forward_impl
    protect = st._Packer.protect_ctx_tensors

    def traced_protect(self, outputs):
        found = protect(self, outputs)
        for node in nodes(outputs):
            bo = getattr(node, "backward_objects", None)
            s = getattr(bo, "S_quantizer", None) if bo is not None else None
            if type(node).__name__.startswith("FusedAttn") or s is not None:
                note({"kind": "protected", "frame": ids.setdefault(id(self), len(ids)), "node": type(node).__name__,
                      "s_id": id(s) if s is not None else None, "s_type": type(s).__name__,
                      "scale_ptr": s.scale.data_ptr() if s is not None and getattr(s, "scale", None) is not None else None,
                      "call_objects": list(self._call_objects(s)) if s is not None else None,
                      "packer": type(self).__name__, "found": found})
        return found

    st._Packer.protect_ctx_tensors = traced_protect
    describe = hygiene.describe_holders

    def deep(target):
        text = list(describe(target))
        for q in gc.get_referrers(target):
            if type(q).__name__ != "Float8Quantizer":
                continue
            made = [(ptr, qid) for ref, ptr, qid in created if ref() is q]
            text.append(f"[diag] quantizer id {id(q)} made by FusedAttnFunc: {made}; target ptr {target.data_ptr()}")
            for r1 in gc.get_referrers(q):
                if r1 is created or isinstance(r1, (list, tuple)) and len(r1) > 64:
                    continue
                keys = [k for k, v in r1.items() if v is q][:4] if isinstance(r1, dict) else None
                text.append(f"[diag]  held by {type(r1).__name__} keys={keys}")
                for r2 in gc.get_referrers(r1)[:6]:
                    if isinstance(r2, dict):
                        k2 = [k for k, v in r2.items() if v is r1][:4]
                        text.append(f"[diag]   which is in dict keys={k2}")
                        for r3 in gc.get_referrers(r2)[:4]:
                            text.append(f"[diag]    dict owned by {type(r3).__name__}")
                    else:
                        text.append(f"[diag]   which is held by {type(r2).__name__}")
        note({"kind": "holders", "text": text})
        return tuple(text)

    hygiene.describe_holders = deep
