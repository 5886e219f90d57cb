"""Prometheus text (a server's ``/metrics``) to numbers: every sample summed
per metric name, or one metric per value of one label."""

import re
from collections.abc import Iterator

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? ([-+\w.]+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of every sample line (comments skipped)."""
    for line in text.splitlines():
        if match := _SAMPLE.match(line):
            name, labels, value = match.groups()
            yield name, dict(_LABEL.findall(labels or "")), float(value)


def parse_metrics(text: str) -> dict[str, float]:
    """Every metric's samples, summed over label sets."""
    values: dict[str, float] = {}
    for name, _, value in samples(text):
        values[name] = values.get(name, 0.0) + value
    return values


def metric_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """One metric's samples summed per value of one label, e.g. per
    ``engine`` (data-parallel replica)."""
    values: dict[str, float] = {}
    for sample_name, labels, value in samples(text):
        if sample_name == name and label in labels:
            key = labels[label]
            values[key] = values.get(key, 0.0) + value
    return values
