"""CHESS's quality-aware backtracking trigger (kvdex.policies.chess, §3.3): the thresholds (a
`kvdex calibrate chess` file, explicit values or the defaults) and the per-sequence check of the
entropy / varentropy of the next-token distribution every ``check_every`` decode steps.

:class:`TriggerMixin` holds the methods; :class:`~kvdex.policies.chess.ChessPolicy` owns the state
and calls ``_due`` from ``on_step``.

A check's result takes effect one decode step late: the check's statistics are computed on the device
and copied to pinned host memory without waiting, and the next step's ``on_step`` reads them (by then
the step that produced them has finished, while the following one already runs). Reading them at once
would make the host wait for the GPU at every check, so the step after it would start from an idle
device (about 0.14 ms a step over a page at the 8B shape, ``docs/policies/chess.md``). A rebuild the
check asks for is therefore requested after the step that follows the check, and logged at that step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvdex.kernels.dispatch import triton_kernel
from kvdex.policies._chess_levels import entropy_varentropy

# Default thresholds when neither a calibration file nor explicit values are given: the 99th
# percentiles measured by `kvdex calibrate chess` on SmolLM2-135M-Instruct (CPU, fp32): LongBench v1
# gov_report/qmsum/multi_news/samsum/lcc (the last 3 samples of each), prompts of 3072 tokens, 192
# greedy tokens with full attention, 76 pages of 32 generated tokens (docs/policies/chess.md,
# docs/policies/chess_calibration_smollm2.json). Thresholds are model-specific: calibrate yours.
DEFAULT_THRESHOLDS = {"entropy": 2.6133, "varentropy": 6.3457, "temporal_varentropy": 3.5523}


class TriggerMixin:
    """The trigger methods of :class:`~kvdex.policies.chess.ChessPolicy`."""

    def _load_thresholds(self) -> tuple[float, float]:
        table = dict(DEFAULT_THRESHOLDS)
        if self.thresholds:
            path = Path(self.thresholds).expanduser()
            if not path.is_file():
                raise ValueError(f"CHESS thresholds file {path} not found; write it with `kvdex calibrate chess`")
            try:
                data = json.loads(path.read_text())
                table = {k: float(data[k]) for k in DEFAULT_THRESHOLDS}
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(
                    f"CHESS thresholds file {path} is not a `kvdex calibrate chess` output "
                    f"(needs numbers {', '.join(DEFAULT_THRESHOLDS)}): {e}"
                ) from None
        h = table["entropy"] if self.entropy_threshold is None else float(self.entropy_threshold)
        key = "varentropy" if self.varentropy == "output" else "temporal_varentropy"
        v = table[key] if self.varentropy_threshold is None else float(self.varentropy_threshold)
        return h, v

    def _due(self, step: int, logits) -> torch.Tensor | None:
        """Sequences whose selection is rebuilt after decode step ``step``: [B] bool, or None."""
        b = self._batch
        if self.trigger == "never":
            return None
        if self.trigger == "always":
            return torch.ones(b, dtype=torch.bool)
        if self.trigger == "interval":
            return torch.ones(b, dtype=torch.bool) if step % self._interval == 0 else None
        due = self._read_check()  # the last check's result, one step late
        if logits is None:
            return due
        fused = triton_kernel("entropy_triton", "accumulate", on=logits)
        if fused is not None:  # CUDA: one kernel (kvdex.kernels.entropy_triton)
            if self._acc is None:
                self._acc = torch.zeros(4, b, dtype=torch.float32, device=logits.device)
            fused(logits, self._acc)
        else:
            h, v = entropy_varentropy(logits)
            acc = torch.stack([h, h.square(), v, torch.ones_like(h)])
            self._acc = acc if self._acc is None else self._acc + acc
        self._nacc += 1
        if self._nacc < self._every:
            return due
        h_page, v_page = self.page_stats(self._acc)
        exceed = self.exceeds(h_page, v_page)
        self._acc, self._nacc = None, 0
        self.checks += b
        self._send_check(step, torch.stack([h_page, v_page, exceed.to(h_page.dtype)]))
        return due

    def _send_check(self, step: int, stats: torch.Tensor) -> None:
        """Start copying a check's [3, B] (entropy, varentropy statistic, exceeded) to the host, unwaited."""
        if not stats.is_cuda:
            self._check = (step, stats, None)
            return
        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
        with torch.cuda.device(stats.device):
            host.copy_(stats, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self._check = (step, host, done)

    def _read_check(self) -> torch.Tensor | None:
        """The sequences [B] bool whose last sent check exceeded the thresholds (None: none, or no check)."""
        if self._check is None:
            return None
        step, host, done = self._check
        self._check = None
        if done is not None:
            done.synchronize()  # the check's own step, already finished or about to
        h_page, v_page, exceed = host.tolist()
        self.check_log += [(step, i, h, v) for i, (h, v) in enumerate(zip(h_page, v_page, strict=True))]
        rows = torch.tensor(exceed) > 0.5
        return rows if bool(rows.any()) else None

    def page_stats(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean entropy, varentropy statistic) [B] from sums acc [4, B] = (H, H^2, V, steps)."""
        n = acc[3]
        h_mean = acc[0] / n
        if self.varentropy == "output":
            return h_mean, acc[2] / n
        return h_mean, (acc[1] / n - h_mean.square()).clamp(min=0)

    def exceeds(self, h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        th, tv = self._tau
        return (h > th) & (v > tv) if self.combine == "and" else (h > th) | (v > tv)
