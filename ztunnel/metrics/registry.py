"""The metric families model and the registry behind `/metrics`, our own.

A collector is anything with `collect()` yielding families; a family (`Metric`) is a name, its
help, its type, and samples (sample name, labels in emission order, value). `CounterMetricFamily`,
`GaugeMetricFamily` and `HistogramMetricFamily` build the samples of their type as the Prometheus
client libraries name them (`_total`; `_bucket` with `le`, then `_count` and `_sum`), so collectors
written against those libraries' families read the same here. `Gauge` and `Counter` are labelled
values for the few families that are not per connection: plain attributes, no lock (each event loop
owns its registry), a child per label set made once and kept. `CounterFamily` and `HistogramFamily`
are the cells the families of a concern resolve once per label set (a connection's, a DNS query's)
and add to on the hot path; `Families` collects those that have samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


class SampleLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def labels(self) -> dict[str, str]: ...

    @property
    def value(self) -> float: ...


class Family(Protocol):
    """What a collector yields: ours (`Metric`), or a family of the same shape."""

    @property
    def name(self) -> str: ...

    @property
    def documentation(self) -> str: ...

    @property
    def type(self) -> str: ...

    @property
    def unit(self) -> str: ...

    @property
    def samples(self) -> Sequence[SampleLike]: ...


class Collector(Protocol):
    def collect(self) -> Iterable[Family]: ...


class Metric:
    """One family and its samples."""

    def __init__(self, name: str, documentation: str, typ: str, unit: str = "") -> None:
        self.name = name
        self.documentation = documentation
        self.type = typ
        self.unit = unit
        self.samples: list[Sample] = []

    def add_sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.samples.append(Sample(name, labels, value))


class CounterMetricFamily(Metric):
    """A counter family: the family is named without `_total`, its samples with it."""

    def __init__(
        self, name: str, documentation: str, value: float | None = None, labels: Sequence[str] = ()
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, "counter")
        self._labelnames = tuple(labels)
        if value is not None:
            self.add_metric((), value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.samples.append(
            Sample(f"{self.name}_total", dict(zip(self._labelnames, labels, strict=True)), value)
        )


class GaugeMetricFamily(Metric):
    def __init__(
        self, name: str, documentation: str, value: float | None = None, labels: Sequence[str] = ()
    ) -> None:
        super().__init__(name, documentation, "gauge")
        self._labelnames = tuple(labels)
        if value is not None:
            self.add_metric((), value)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.samples.append(Sample(self.name, dict(zip(self._labelnames, labels, strict=True)), value))


class HistogramMetricFamily(Metric):
    def __init__(self, name: str, documentation: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, "histogram")
        self._labelnames = tuple(labels)

    def add_metric(
        self, labels: Sequence[str], buckets: Sequence[tuple[str, float]], sum_value: float
    ) -> None:
        """`buckets`: (upper bound as text, cumulative count), ascending, `+Inf` last."""
        base = list(zip(self._labelnames, labels, strict=True))
        for bound, count in buckets:
            self.samples.append(Sample(f"{self.name}_bucket", dict([*base, ("le", bound)]), count))
        if float(buckets[0][0]) >= 0:
            self.samples.append(Sample(f"{self.name}_count", dict(base), buckets[-1][1]))
            self.samples.append(Sample(f"{self.name}_sum", dict(base), sum_value))


class CollectorRegistry:
    """Collectors in the order they were registered; `collect` yields their families in that order."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        self._collectors.append(collector)

    def collect(self) -> Iterator[Family]:
        for collector in list(self._collectors):
            yield from collector.collect()


class GaugeCell:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, n: float = 1) -> None:
        self.value += n

    def dec(self, n: float = 1) -> None:
        self.value -= n

    def set(self, value: float) -> None:
        self.value = value


class _Labelled:
    """A family of cells, one per label set (made on first use, then kept)."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._cells: dict[tuple[str, ...], GaugeCell] = {}
        if not self.labelnames:
            self._cells[()] = GaugeCell()
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str, **by_name: str) -> GaugeCell:
        key = values or tuple(by_name[n] for n in self.labelnames)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = GaugeCell()
        return cell

    def collect(self) -> Iterator[Metric]:
        family = Metric(self.name, self.documentation, self.kind)
        sample = f"{self.name}_total" if self.kind == "counter" else self.name
        for values, cell in list(self._cells.items()):
            family.add_sample(sample, dict(zip(self.labelnames, values, strict=True)), cell.value)
        yield family


class Gauge(_Labelled):
    """A gauge; without label names it is its own single cell (`inc`, `dec`, `set`)."""

    def inc(self, n: float = 1) -> None:
        self._cells[()].inc(n)

    def dec(self, n: float = 1) -> None:
        self._cells[()].dec(n)

    def set(self, value: float) -> None:
        self._cells[()].set(value)


class Counter(_Labelled):
    """A counter without `_created` samples (the reference emits none)."""

    kind = "counter"

    def inc(self, n: float = 1) -> None:
        self._cells[()].inc(n)


class CounterCell:
    """One labelled counter value; `inc` is the hot-path operation."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n


class CounterFamily:
    """A counter's cells by label values, without `_created` samples."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.cells: dict[tuple[str, ...], CounterCell] = {}

    def cell(self, values: tuple[str, ...]) -> CounterCell:
        cell = self.cells.get(values)
        if cell is None:
            cell = self.cells[values] = CounterCell()
        return cell

    def forget(self, values: tuple[str, ...]) -> None:
        self.cells.pop(values, None)

    def family(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, cell in list(self.cells.items()):
            fam.add_metric(values, cell.value)
        return fam


class HistogramFamily:
    """A histogram's cells by label values, without `_created` samples."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.buckets = buckets
        self.cells: dict[tuple[str, ...], list[float]] = {}  # per bucket (not cumulative), then +Inf, sum

    def observe(self, values: tuple[str, ...], value: float) -> None:
        cell = self.cells.get(values)
        if cell is None:
            cell = self.cells[values] = [0.0] * (len(self.buckets) + 2)
        i = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        cell[i] += 1
        cell[-1] += value

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, cell in list(self.cells.items()):
            cumulative, buckets = 0.0, []
            for bound, count in zip((*map(go_float, self.buckets), "+Inf"), cell[:-1], strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            fam.add_metric(list(values), buckets, cell[-1])
        return fam


class Families:
    """A collector of cell families, in order, each once it has a sample."""

    def __init__(self, families: Iterable[CounterFamily | HistogramFamily]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        for f in self._families:
            if f.cells:
                yield f.family()


def go_float(value: float) -> str:
    """A float as Go's `strconv` writes it in Prometheus text (exponent form past 6 integer digits)."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text
