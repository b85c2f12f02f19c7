"""The cost model of ``polytrain advise``: one strategy's examples/sec and time to a target from a few numbers
measured on this machine, for any number of workers, link rate and stragglers. Pure data and arithmetic (no
processes): :func:`predict` is what docs/choosing.md writes down, term by term.

A :class:`Profile` is one strategy as measured in a short run on loopback (where the link costs ~nothing):

* ``step_s``: seconds of one step of one worker on ``batch`` examples with nothing on the wire (its forward,
  backward, update and the strategy's own work: compression, quantisation, a server's);
* ``payload``: bytes of what one exchange hands to the transport (a gradient bucket's sum, the parameters
  at a meeting, a quantised outer gradient, a pushed gradient), and ``every``: steps per exchange;
* ``pattern``: how the payload crosses the links — ``ring`` (all-reduce: each worker sends and receives
  ``2 (N - 1) / N`` payloads), ``gather`` (all-gather: ``N - 1`` payloads), ``server`` (parameter servers:
  each slice pushes one payload and pulls one back, and the servers' links carry every worker's);
* ``overlap_s``: seconds of compute an exchange may hide behind (diloco ``--overlap-steps T``: T steps);
* ``examples_to_target``: examples the run had trained on when an evaluation first reached the target.

A :class:`Scenario` is the cluster: ``workers`` N, each on a link of ``link_bps`` bits/s each way (full
duplex), ``latency_s`` per message, stragglers, parameter ``servers``.

Per step of every worker (persistent straggler factors ``f_i``, or ``random:P:F``):

* lock-step (``every`` = 1: sync): ``step = step_s * max_i f_i + wire``; with ``random:P:F`` the slowest of N
  in a step is F slow with probability ``1 - (1 - P)^N``;
* periodic (``every`` = H: local-sgd, diloco): each worker runs H steps on its own, so a round is
  ``H * step_s * max_i f_i`` (a random straggler averages out over H steps: ``1 + (F - 1) P``) plus the part
  of the exchange not hidden behind ``overlap_s``; per step, the round over H;
* ``wire = bytes / (link_bps / 8) + messages * latency_s``, ring: ``2 (N - 1) / N * payload`` and
  ``2 (N - 1)`` messages; gather: ``(N - 1) * payload`` and ``N - 1`` messages;
* server (async): a worker's slice takes ``step_s * f_i + 2 t (1 + u) + 2 latency_s`` with
  ``t = payload / (link_bps / 8)`` (a push, then a pull) and nobody waits for anyone. The servers' links are
  shared: while another worker's push (or pull) crosses them, this one's goes at half the rate, and the other
  ``N - 1`` workers occupy a server's link in each direction for ``u = (N - 1) t / (S c)`` of a slice's time
  ``c`` (solved for ``c``). Slices/s is the sum of ``1 / c_i``, capped by the servers' links:
  ``servers * link_bps / 8 / payload`` slices/s.

examples/s = N * batch / step (server: slices/s * batch); time to target = examples_to_target / examples/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PATTERNS = ("ring", "gather", "server", "none")


@dataclass(frozen=True)
class Profile:
    strategy: str  # the spec, e.g. "diloco:sync_every=8"
    step_s: float  # one worker's step on `batch` examples, nothing on the wire
    batch: int  # examples per worker per step
    payload: float  # bytes handed to the transport per exchange
    every: int = 1  # steps per exchange
    pattern: str = "ring"
    overlap_s: float = 0.0  # compute an exchange may hide behind
    examples_to_target: float | None = None  # None: the measured run never reached the target
    note: str = ""

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {self.pattern!r}")


@dataclass(frozen=True)
class Scenario:
    workers: int
    link_bps: float
    latency_s: float = 0.0
    #: persistent stragglers: {worker rank: factor}
    slow: dict[int, float] = field(default_factory=dict)
    #: random stragglers: (probability per worker per step, factor)
    random: tuple[float, float] | None = None
    servers: int = 1

    def factors(self) -> list[float]:
        return [self.slow.get(i, 1.0) for i in range(self.workers)]


@dataclass(frozen=True)
class Prediction:
    strategy: str
    examples_per_s: float
    step_s: float  # seconds per step of the whole job (per slice for a server pattern)
    wire_s: float  # of which on the links, not hidden
    wire_bytes_per_step: float  # what one worker sends per step
    time_to_target_s: float | None

    @property
    def wire_share(self) -> float:
        return self.wire_s / self.step_s if self.step_s > 0 else 0.0


def wire_bytes(payload: float, pattern: str, workers: int) -> float:
    """Bytes one worker sends (and receives) in one exchange of ``payload``."""
    if workers < 2 or pattern == "none":
        return 0.0
    if pattern == "ring":
        return 2.0 * (workers - 1) / workers * payload
    if pattern == "gather":
        return float(workers - 1) * payload
    return 2.0 * payload  # server: push, then pull (counted as the sum: they cross the link one after another)


def messages(pattern: str, workers: int) -> int:
    if workers < 2 or pattern == "none":
        return 0
    return {"ring": 2 * (workers - 1), "gather": workers - 1, "server": 2}[pattern]


def exchange_s(profile: Profile, scenario: Scenario) -> float:
    """Seconds one exchange keeps a worker's link busy."""
    moved = wire_bytes(profile.payload, profile.pattern, scenario.workers)
    return moved * 8 / scenario.link_bps + messages(profile.pattern, scenario.workers) * scenario.latency_s


def predict(profile: Profile, scenario: Scenario) -> Prediction:
    n, batch = scenario.workers, profile.batch
    factors = scenario.factors()
    exchange = exchange_s(profile, scenario)
    if profile.pattern == "server":
        slices = [_slice_s(profile.step_s * _mean_factor(f, scenario.random), exchange, profile, scenario)
                  for f in factors]
        rate = sum(1.0 / s for s in slices)
        if n > 1 and profile.payload > 0:
            rate = min(rate, scenario.servers * scenario.link_bps / 8 / profile.payload)
        examples = rate * batch
        step = n / rate  # a "step": one slice from every worker, on average
        wire = min(exchange, step)
        moved = wire_bytes(profile.payload, "server", n)
    elif profile.every <= 1:
        step = profile.step_s * _max_factor(factors, scenario.random) + exchange
        wire = exchange
        examples = n * batch / step
        moved = wire_bytes(profile.payload, profile.pattern, n)
    else:
        h = profile.every
        compute = h * profile.step_s * max(_mean_factor(f, scenario.random) for f in factors)
        wire = max(0.0, exchange - profile.overlap_s)
        step = (compute + wire) / h
        wire /= h
        examples = n * batch / step
        moved = wire_bytes(profile.payload, profile.pattern, n) / h
    to_target = profile.examples_to_target / examples if profile.examples_to_target and examples > 0 else None
    return Prediction(profile.strategy, examples, step, wire, moved, to_target)


def _slice_s(compute: float, exchange: float, profile: Profile, scenario: Scenario) -> float:
    """One worker's slice with the servers' links shared: the fixed point of ``c = compute + exchange (1 + u)``,
    ``u = (N - 1) t / (S c)`` (``t``: one transfer's seconds alone), which the iteration reaches from above."""
    n, transfer = scenario.workers, profile.payload * 8 / scenario.link_bps
    c = compute + exchange
    for _ in range(50):
        busy = min(1.0, (n - 1) * transfer / (scenario.servers * c)) if c > 0 else 0.0
        c = compute + exchange * (1 + busy)
    return c


def _max_factor(factors: list[float], random: tuple[float, float] | None) -> float:
    """The slowest worker's factor in one step (expected, with random stragglers)."""
    worst = max(factors) if factors else 1.0
    if random is None:
        return worst
    p, f = random
    slowed = 1 - (1 - p) ** len(factors)
    return max(worst, 1 + (f - 1) * slowed)


def _mean_factor(factor: float, random: tuple[float, float] | None) -> float:
    if random is None:
        return factor
    p, f = random
    return factor * (1 + (f - 1) * p)


def rank(predictions: list[Prediction]) -> list[Prediction]:
    """Fastest to the target first; those that never reached it after, by examples/s."""
    reached = sorted((p for p in predictions if p.time_to_target_s is not None), key=lambda p: p.time_to_target_s)
    never = sorted((p for p in predictions if p.time_to_target_s is None), key=lambda p: -p.examples_per_s)
    return reached + never
