"""A strict little parser of the Prometheus text format, shared by the status tests (tests/ is on sys.path)."""

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')


def _unescape(v: str) -> str:
    return re.sub(r'\\([\\"n])', lambda m: "\n" if m.group(1) == "n" else m.group(1), v)


def parse_prometheus(text: str):
    """Return (types, helps, samples) where samples is a list of (name, labels dict, float)."""
    types, helps, samples = {}, {}, []
    assert text.endswith("\n"), "exposition must end with a newline"
    for line in text.splitlines():
        assert line, "no blank lines expected"
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text
            continue
        if line.startswith("# TYPE "):
            name, mtype = line[7:].split(" ")
            assert mtype in {"counter", "gauge", "histogram", "summary", "untyped"}
            assert name not in types, f"duplicate TYPE for {name}"
            types[name] = mtype
            continue
        assert not line.startswith("#"), line
        m = _SAMPLE.match(line)
        assert m, f"bad sample line: {line!r}"
        name, _, label_str, value = m.groups()
        labels = {}
        if label_str:
            pos = 0
            while pos < len(label_str):
                lm = _LABEL.match(label_str, pos)
                assert lm, f"bad labels in {line!r} at {label_str[pos:]!r}"
                labels[lm.group(1)] = _unescape(lm.group(2))
                pos = lm.end()
        assert name in types, f"sample {name} before its TYPE line"
        samples.append((name, labels, float(value)))
    return types, helps, samples


def value_of(samples, metric, **labels):
    found = [v for n, ls, v in samples if n == metric and all(ls.get(k) == val for k, val in labels.items())]
    assert len(found) == 1, f"{metric}{labels}: {found}"
    return found[0]
