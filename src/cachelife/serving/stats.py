"""`EngineStats`: what `Engine.stats()` reports, a snapshot of the scheduler's counters."""

from __future__ import annotations

from attrs import frozen


@frozen(kw_only=True)
class EngineStats:
    """A snapshot: requests decoding (a beam request holds a group of rows), prepared requests waiting for
    rows, requests held (submitted, not done), steps run, the cache's write slot, how often the rows' content
    was moved to make room, requests that joined, the programs the batch keeps, and the scheduler's wall
    seconds spent so far admitting newcomers (prefill, placement, first token) and running steps (calls of the
    step, hand-backs). Of those, `prefill_seconds` went to the newcomers' prefills and `collect_seconds` to
    reading the rows' lengths and end flags after each call of the step (which waits for the device to finish
    it) and handing tokens over. `prefills` counts the forwards over newcomers' prompts (`joint_prefill`),
    `encoder_forwards` those over the `encoder_calls` of newcomers' encoders (`encoder_calls`): fewer forwards
    than calls is encoders run together."""

    decoding: int
    waiting: int
    held: int
    steps: int
    slot: int
    moves: int
    joins: int
    join_seconds: float
    step_seconds: float
    prefill_seconds: float
    collect_seconds: float
    programs: int  # programs the batch keeps (the per-row pipeline's variants and programs of their own)
    prefills: int
    encoder_calls: int = 0  # newcomers' encoder calls gathered (`encoder_calls`), and the forwards that ran them
    encoder_forwards: int = 0
