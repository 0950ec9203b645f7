"""Reads kda-bench's markdown output: the one parser behind scripts/bench-ab.py (two builds, as
ratios) and scripts/bench-table.py (one build over several runs, against the anchors and the
targets of docs/PERFORMANCE.md). A file may hold several runs one after another (each run starts
with its prefill table's "### CUDA prefill" header, as when runs are appended to one log).
"""


def parse_runs(path):
    """A list of runs, one per kda-bench run in the file; each run maps a table ("prefill",
    "decode", "verify", "host") to {row key: {column header: cell}}. Row keys: the case name
    (prefill), "B=N state" (decode; outputs older than the state column say f32), "tokens B state
    form" (verify; the commit-of-layers table's fourth cell is the layer count), the call (host)."""
    runs = []
    run = None
    table = None
    header = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("### "):
                table = (
                    "verify" if "verify" in line or "commit" in line
                    else "prefill" if "prefill" in line
                    else "decode" if "decode" in line
                    else "host"
                )
                if run is None or (table == "prefill" and run.get("prefill")):
                    run = {}
                    runs.append(run)
                run.setdefault(table, {})
                header = None
                continue
            if not line.startswith("|") or line.startswith("|---") or table is None:
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
                continue
            row = dict(zip(header, cells))
            if table == "decode":
                key = f"B={row.get('B', cells[0])} {row.get('state', 'f32')}"
            elif table == "verify":  # tokens, B, state, and the form or the layer count
                key = " ".join(cells[:4])
            else:
                key = cells[0]
            run[table][key] = row
    return runs


def number(cell):
    """A cell's value as a float ("1.38x" and "86%" included), or None ("-", text)."""
    try:
        return float(cell.rstrip("x%"))
    except (AttributeError, ValueError):
        return None


def times(run):
    """{(table, key): time} of one run: prefill ms, decode us per step, verify total us, host us
    per call with the pointer checks on and off."""
    out = {}
    for key, row in run.get("prefill", {}).items():
        if number(row.get("ms")) is not None:
            out[("prefill", key)] = number(row["ms"])
    for key, row in run.get("decode", {}).items():
        if number(row.get("us per step")) is not None:
            out[("decode", key)] = number(row["us per step"])
    for key, row in run.get("verify", {}).items():
        if number(row.get("total us")) is not None:
            out[("verify", key)] = number(row["total us"])
    for key, row in run.get("host", {}).items():
        on, off = number(row.get("host us per call")), number(row.get("checks off"))
        if on is not None and off is not None:
            out[("host", key + " (checks on)")] = on
            out[("host", key + " (checks off)")] = off
    return out
