"""Diagnostic only (s65, issue 30 item 1): with $DIAG_OUT set, each of the first $DIAG_REPLAYS
replays of a --cg-slot-capture layer is set beside the same layer run eagerly (no_grad) on the same
inputs right after it: the outputs' largest difference, and whether the eager call's weight
quantization changed the FP8 weight workspaces the replay left (a stale workspace would)."""
import json
import os

OUT = os.environ.get("DIAG_OUT")
if OUT:
    import torch
    from megatron_cg_plugin.capture import slot_backend

    LIMIT = int(os.environ.get("DIAG_REPLAYS", "40"))
    state = {"n": 0}
    make = slot_backend.SlotBackend.make_graphed_callables

    def tagged(self, callables, sample_args, **kwargs):
        graphs = make(self, callables, sample_args, **kwargs)
        for graph, layer in zip(graphs, callables):
            graph._diag_layer = layer
        return graphs

    slot_backend.SlotBackend.make_graphed_callables = tagged

    def workspaces(layer):
        out = {}
        for name, module in layer.named_modules():
            for key, ws in getattr(module, "_fp8_workspaces", {}).items():
                for attr, value in vars(ws).items():
                    if isinstance(value, torch.Tensor):
                        out[f"{name}.{key}.{attr}"] = value.clone()
        return out

    def amax_scale(layer):
        out = {}
        for name, module in layer.named_modules():
            for group, quantizers in getattr(module, "quantizers", {}).items():
                for i, q in enumerate(quantizers or ()):
                    for attr in ("scale", "amax"):
                        value = getattr(q, attr, None)
                        if isinstance(value, torch.Tensor):
                            out[f"{name}.{group}[{i}].{attr}"] = value.clone()
        return out

    call = slot_backend.SlotLayerGraph.__call__

    def diag_call(self, *args, **kwargs):
        outputs = call(self, *args, **kwargs)
        layer = getattr(self, "_diag_layer", None)
        if layer is None or state["n"] >= LIMIT:
            return outputs
        state["n"] += 1
        replayed = [o.detach().clone() for o in outputs]
        before_ws, before_q = workspaces(layer), amax_scale(layer)
        inputs = {name: kwargs[name] for name in self.input_names}
        with torch.no_grad():
            eager = layer.forward(*args, **inputs)
        eager = eager if isinstance(eager, tuple) else (eager,)
        after_ws, after_q = workspaces(layer), amax_scale(layer)
        diff = (replayed[0].float() - eager[0].float()).abs().max().item()
        ws_changed = sorted(k for k in before_ws if not torch.equal(before_ws[k], after_ws.get(k, before_ws[k])))
        q_changed = sorted(k for k in before_q if not torch.equal(before_q[k], after_q.get(k, before_q[k])))
        with open(OUT, "a") as f:
            f.write(json.dumps({"replay": state["n"], "layer": self.label, "first": kwargs.get("is_first_microbatch"),
                                "max_abs_diff": diff, "equal": diff == 0.0,
                                "workspaces_changed_by_eager": ws_changed[:12], "n_workspaces": len(before_ws),
                                "quantizer_state_changed_by_eager": q_changed[:12]}) + "\n")
        return outputs

    slot_backend.SlotLayerGraph.__call__ = diag_call
