"""Is a soak row flat? Each sampled series fitted against the step, less the growth a decode is expected to add.

Each series is fitted by least squares against the step (:func:`fit`: its slope, per step) and reported with
its growth from the first to the last sample. A decode context grows by one token per step: that growth is
expected (:func:`expected_per_step`): nothing where every buffer was reserved up front, else one token's KV
(:func:`kv_bytes_per_token`) where the KV lives. ``excess`` = slope - expected. A row is *flat*
(:func:`judge`) when, for device memory, tensors and objects, the excess stays within ``--tolerance`` (a
fraction of one token's KV per step for bytes; objects per step for counts); host RSS is judged with
``--rss-tolerance`` (bytes per step: the allocator's own noise).
"""

from __future__ import annotations

import torch

from kvdex.bench.soak.config import SoakConfig

SERIES = ("device", "device_reserved", "rss", "tensors", "tensor_bytes", "objects")


def fit(steps: list[int], values: list[float]) -> dict:
    """Least-squares slope (per step) of ``values`` against ``steps``, and the growth from first to last."""
    n = len(steps)
    if n < 2:
        return {"slope": 0.0, "growth": 0.0, "samples": n}
    mx, my = sum(steps) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    sxy = sum((x - mx) * (y - my) for x, y in zip(steps, values, strict=True))
    return {"slope": sxy / sxx if sxx else 0.0, "growth": float(values[-1] - values[0]), "samples": n}


def kv_bytes_per_token(model, batch: int, dtype: torch.dtype) -> tuple[int, int]:
    """(K+V bytes one decoded token adds over all layers and the batch, the number of layers)."""
    from kvdex.hf.model_parts import head_geometry, text_config

    _, kv_heads, head_dim = head_geometry(model)
    layers = text_config(model).num_hidden_layers
    return layers * kv_heads * head_dim * 2 * dtype.itemsize * batch, layers


def expected_per_step(
    cfg: SoakConfig, spec: str, storage: str, kv_token: int, layers: int, device: torch.device
) -> dict:
    """Expected growth per step of each series: nothing when the buffers were reserved, else one token's KV
    where it lives (an offloaded sparse layer's middle on the host, every other layer's KV on the device;
    on a CPU device and host are one memory). ``full`` offloaded attends the whole middle: its sparse layers'
    device working set holds it and the host staging buffer that carries it there holds it again, so both
    grow by their KV per token whatever was reserved."""
    dense = min(cfg.dense_layers, layers)
    working = kv_token * (layers - dense) / layers if storage == "offload" and spec.split(":")[0] == "full" else 0.0
    if cfg.reserve:
        if device.type != "cuda":
            return {"device": 2 * working, "rss": 2 * working}
        return {"device": working, "rss": working}
    if device.type != "cuda":
        return {"device": kv_token + 2 * working, "rss": kv_token + 2 * working}
    if storage == "device":
        return {"device": float(kv_token), "rss": 0.0}
    return {"device": kv_token * dense / layers + working, "rss": kv_token * (layers - dense) / layers + working}


def judge(cfg: SoakConfig, samples: list[dict], expect: dict, kv_token: int) -> tuple[dict, dict, dict]:
    """(fits, limits per step, flat) of a row's ``samples``: each sampled series' fit with its expected and
    excess growth, the tolerance each judged series is held to, and whether its excess stays within it."""
    steps = [x["step"] for x in samples]
    fits, flat = {}, {}
    for key in SERIES:
        if key not in samples[0]:
            continue
        f = fit(steps, [x[key] for x in samples])
        f["expected_per_step"] = expect.get(key, 0.0)
        f["excess_per_step"] = f["slope"] - f["expected_per_step"]
        f["excess_total"] = f["excess_per_step"] * (steps[-1] - steps[0])
        fits[key] = f
    limits = {"device": cfg.tolerance * kv_token, "rss": cfg.rss_tolerance}
    limits |= {"tensors": cfg.object_tolerance, "objects": cfg.object_tolerance}
    for key, lim in limits.items():
        if key in fits:
            flat[key] = fits[key]["excess_per_step"] <= lim
    return fits, limits, flat
