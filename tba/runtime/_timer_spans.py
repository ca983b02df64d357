"""The spans a :class:`~tba.runtime._timer.LayerTimer` reports from its stamps: each layer's backward, and the step's
forward and backward as the cost model predicts them (wall-clock, CPU, and the seconds other compute threads waited)."""

from __future__ import annotations

from typing import Any

from tba.runtime import _preempted


def own_s(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """Wall-clock seconds between two stamps less what the thread waited inside tba meanwhile."""
    return end[0] - start[0] - (end[2] - start[2])


class LayerSpans:
    """What :class:`~tba.runtime._timer.LayerTimer` derives from its stamps; it sets every attribute used here."""

    forward_s: list[float | None]
    _started: list[Any]
    _ended: list[Any]
    _grad_at_output: list[Any]
    _grad_at_input: list[Any]
    _marks: dict[str, Any]

    def backward_s(self, cpu: bool = False) -> list[float | None]:
        """Per layer: seconds from the gradient reaching its output to reaching its input, or None.

        ``cpu``: the backward thread's CPU seconds over that span instead of wall-clock seconds (less
        the seconds the thread waited inside tba).
        """
        out: list[float | None] = []
        for at_output, at_input in zip(self._grad_at_output, self._grad_at_input):
            if at_output is None or at_input is None:
                out.append(None)
            elif cpu:
                out.append(at_input[1] - at_output[1])
            else:
                out.append(own_s(at_output, at_input))
        return out

    def span_cpu_s(self) -> float | None:
        """:meth:`span_s` in the CPU seconds of the threads that took the stamps (one thread, the
        training thread, for a CPU model); None when a stamp is missing."""
        return self._span(1)

    def span_s(self) -> float | None:
        """Wall-clock seconds of what the cost model predicts: from the first layer's forward to the
        last layer's forward end, plus from the gradient reaching the last layer's output to reaching
        the first layer's input (what runs between, the head and the loss, left out); None when a stamp
        is missing."""
        return self._span(0)

    def span_preempted_s(self) -> float | None:
        """Seconds the process's other compute threads waited for a CPU over :meth:`span_s`'s two
        parts (Note [A preempted partner costs the training thread CPU time] in
        ``tba/runtime/_preempted.py``); None when not measured (a GPU, no schedstats, a part missing)."""
        if self._span(0) is None:
            return None
        marks = self._marks
        forward = _preempted.waited_s(marks.get("forward_start"), marks.get("forward_end"),
                                      self._ended[-1][0] - self._started[0][0])
        backward = _preempted.waited_s(marks.get("backward_start"), marks.get("backward_end"),
                                       self._grad_at_input[0][0] - self._grad_at_output[-1][0])
        return None if forward is None or backward is None else forward + backward

    def _span(self, clock: int) -> float | None:
        if not self._started or self.forward_s[0] is None or self.forward_s[-1] is None:
            return None
        backward_start, backward_end = self._grad_at_output[-1], self._grad_at_input[0]
        if backward_start is None or backward_end is None:
            return None
        forward = self._ended[-1][clock] - self._started[0][clock]
        return forward + backward_end[clock] - backward_start[clock]
