"""When a pipeline rank's sends are known to have been received (graph and schedule logic, no tensors).

A rank keeps each tensor it sends (``torch.distributed.isend``) until the send completes, and gloo's ``Work``
reports completion only when waited on; waiting on a send whose receiver has not posted its receive could
stall the sender. Every rank's messages follow from the schedule: ``message_events`` lists a device's
receives and sends in the order ``PipelineStep.schedule`` makes them. If peer ``P`` receives our message
``t`` and later sends us message ``u``, then once we have received ``u``, ``P`` has received ``t``: waiting on
``t`` then returns at once, and its buffer can go (``send_releases``). A forward activation, for example, is
released when the gradient of the same micro-batch comes back, instead of at the end of the step.
"""
from __future__ import annotations

__all__ = ["message_events", "send_releases"]


def message_events(spec, devices: int, microbatches: int, order: list[tuple[str, int, int]],
                   chunks: list[int], device: int) -> list[tuple[str, int, int]]:
    """Device ``device``'s messages in schedule order: ("recv" | "send", peer device, tag) (``order``: its
    ``ir.stages.schedule_order``; ``chunks``: its virtual stages). Values between two chunks of the same
    device are not messages."""
    m, events = microbatches, []

    def add(kind: str, peers, k: int) -> None:
        for _, peer, index in peers:
            if peer % devices != device:
                events.append((kind, peer % devices, index * (m + 1) + k))

    for key, v, k in order:
        ps = spec.stages[v].forward if key == "F" else spec.stages[v].backward
        add("recv", ps.recvs, k)
        add("send", ps.sends, k)
    for v in chunks:
        add("send", spec.stages[v].update.sends, m)
    for v in chunks:
        add("recv", spec.stages[v].update.recvs, m)
    return events


def send_releases(events: dict[int, list[tuple[str, int, int]]], device: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(peer, tag of a message received from it) -> the sends (peer, tag) of ``device`` that the peer received
    before sending that message (``events``: every device's ``message_events``)."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    seen: dict[int, tuple[dict, list]] = {}
    for kind, peer, tag in events[device]:
        if kind != "send":
            continue
        if peer not in seen:   # where the peer receives each of our tags; its next send to us from each event on
            theirs = events[peer]
            nxt: list[int | None] = [None] * (len(theirs) + 1)
            for i in range(len(theirs) - 1, -1, -1):
                k, p, t = theirs[i]
                nxt[i] = t if k == "send" and p == device else nxt[i + 1]
            seen[peer] = ({t: i for i, (k, p, t) in enumerate(theirs) if k == "recv" and p == device}, nxt)
        at, nxt = seen[peer]
        later = nxt[at[tag] + 1]
        if later is not None:
            out.setdefault((peer, later), []).append((peer, tag))
    return out
