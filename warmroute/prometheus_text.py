"""Reading Prometheus text exposition (an engine's or a router's /metrics) with prometheus_client's parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value) of each series


def read_samples(text: str, names: tuple[str, ...]) -> Samples:
    """Every sample of the named series (exact sample names, e.g. `vllm:prefix_cache_hits_total`) in `text`;
    ValueError if a line of theirs is not Prometheus text."""
    samples: Samples = {}
    try:
        for family in text_string_to_metric_families(_lines_of(text, names)):
            for s in family.samples:
                if s.name in names:
                    samples.setdefault(s.name, []).append((s.labels, s.value))
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(str(exc)) from None
    return samples


def sample_sum(text: str, name: str) -> float | None:
    """The sum of every series of sample `name` (all label sets); None if the page has none."""
    found = read_samples(text, (name,)).get(name)
    return None if found is None else sum(v for _, v in found)


def _lines_of(text: str, names: tuple[str, ...]) -> str:
    """Only the lines of the names we read: a page is mostly histograms we would parse for nothing."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2] in names:
                keep.append(line)
        elif line.startswith(names):
            keep.append(line)
    return "\n".join(keep) + "\n"
