"""The configuration tree as an operator meets it: every flag of `serve` and `plan` fed hostile
values (0, negative, huge, the wrong type, control characters, `--block-size 7`) exits 2 with one
line naming the flag, before any port is bound; the same through `EMBEDSERVE_<NAME>`; the
compute-path switches are fields of the tree and `plan` prints them."""

from __future__ import annotations

import math

import pytest

from embedserve import cli
from embedserve.config import SECTIONS, ServerConfig, config_fields, field_default, flag
from embedserve.errors import ConfigError
from kernels import compute

BASE = ["--model", "all-MiniLM-L6-v2", "--generate-model", "none"]
HUGE = 10 ** 13


def _hostile(f) -> list[str]:
    """Values of field `f` that its limits refuse, derived from its kind and limits."""
    m, kind = f.metadata, str(f.type)
    if kind == "bool":
        return []                                   # a switch: only `--x` / `--no-x`; the env test covers values
    if kind.startswith(("int", "float")):
        values = ["abc", "1.5e"] if kind.startswith("float") else ["abc", "2.5"]
        if kind.startswith("float"):
            values += ["nan", "inf"]
        for v in (0, -1, HUGE):
            refused = (m["lo"] is not None and v < m["lo"]) or (m["above"] is not None and v <= m["above"]) \
                or (m["hi"] is not None and v > m["hi"]) or (m["below"] is not None and v >= m["below"]) \
                or (m["choices"] and v not in m["choices"])
            if refused:
                values.append(str(v))
        if f.name == "block_size":
            values.append("7")
        return values
    values = ["bad\x01value", "x" * 5000]
    if m.get("choices"):
        values += ["bogus", ""]
    if f.name in ("model", "host", "served_model_name", "device", "dtype"):
        values += [""]
    if f.name in ("model", "generate_model", "api_key_file"):
        values += ["/no/such/dir/0"]
    if f.name in ("device", "dtype"):
        values += ["tpu" if f.name == "device" else "fp64"]
    if f.name == "api_key":
        values += ["two words"]
    return values


CASES = [(f.name, v) for f in config_fields() for v in _hostile(f)]


def test_every_numeric_and_text_flag_has_hostile_cases():
    covered = {name for name, _ in CASES}
    assert covered == {f.name for f in config_fields() if str(f.type) != "bool"}
    assert ("block_size", "7") in CASES and ("port", "0") in CASES and ("port", str(HUGE)) in CASES


@pytest.fixture
def no_bind(monkeypatch):
    """Serving gets as far as binding the port: recorded, never done."""
    from embedserve import serve
    bound, before = [], compute.current()
    monkeypatch.setattr(serve.DrainingServer, "run", lambda self, *a, **k: bound.append(self.config.port))
    for f in config_fields():
        monkeypatch.delenv("EMBEDSERVE_" + f.name.upper(), raising=False)
    yield bound
    compute.configure(before)


def _one_line_naming(capsys, needle: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedserve") and "Traceback" not in err, err[-2000:]
    assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "plan"])
@pytest.mark.parametrize("name,value", CASES, ids=[f"{n}={v[:12]!r}" for n, v in CASES])
def test_a_hostile_flag_value_exits_2_with_one_line_naming_the_flag(command, name, value, no_bind, capsys,
                                                                   tmp_path):
    base = {"--model": "all-MiniLM-L6-v2", "--generate-model": "none", "--index-dir": str(tmp_path / "ix")}
    base.pop(flag(name), None)                     # the flag under test is given once, hostile
    rc = cli.main([command, *(a for kv in base.items() for a in kv), f"{flag(name)}={value}"])
    line = _one_line_naming(capsys, flag(name))
    assert no_bind == [], f"{flag(name)}={value!r} reached the port: {line}"
    assert rc == 2, line


@pytest.mark.parametrize("f", [f for f in config_fields() if str(f.type).startswith(("int", "float", "bool"))
                               or f.metadata.get("choices")], ids=lambda f: f.name)
def test_a_hostile_environment_value_names_the_variable(f, no_bind, monkeypatch, capsys, tmp_path):
    var = "EMBEDSERVE_" + f.name.upper()
    kind = str(f.type)
    value = "maybe" if kind == "bool" else ("bogus" if f.metadata.get("choices") else "lots")
    monkeypatch.setenv(var, value)
    assert cli.main(["plan", *BASE, "--index-dir", str(tmp_path / "ix")]) == 2
    _one_line_naming(capsys, f"{var}={value!r}")
    assert no_bind == []


def test_block_size_zero_and_seven_refused_before_anything_loads(no_bind, capsys, tmp_path):
    for bad in ("0", "7"):
        assert cli.main(["serve", *BASE, "--index-dir", str(tmp_path), "--block-size", bad]) == 2
        assert "--block-size " + bad in _one_line_naming(capsys, "--block-size")
    assert no_bind == []


def test_a_good_configuration_reaches_the_port_and_sets_the_compute_paths(no_bind, capsys, tmp_path):
    """The fixture's patch is real: a valid setting does reach the port, with the switches set
    for the process before any model loads."""
    rc = cli.main(["serve", *BASE, "--index-dir", str(tmp_path), "--port", "8123", "--cpu-attention", "sdpa",
                   "--no-decode-gemv", "--faiss-threads", "2"])
    assert rc == 0 and no_bind == [8123]
    assert compute.current().cpu_attention == "sdpa" and compute.current().decode_gemv is False
    from index.dense import search_threads, set_search_threads
    assert search_threads() == 2
    set_search_threads(1)


def test_plan_prints_the_compute_paths(capsys, tmp_path, monkeypatch):
    for f in config_fields():
        monkeypatch.delenv("EMBEDSERVE_" + f.name.upper(), raising=False)
    monkeypatch.setenv("EMBEDSERVE_PACKED_LINEAR", "0")               # the env fallback of a switch
    before = compute.current()
    try:
        assert cli.main(["plan", *BASE, "--index-dir", str(tmp_path), "--int8-kernel", "fbgemm"]) == 0
        out = capsys.readouterr().out
        assert "compute paths: " in out and "int8_kernel = fbgemm" in out and "packed_linear = False" in out, out
        assert compute.current().packed_linear is False                # set for the process, as serve does
    finally:
        compute.configure(before)


def test_the_tree_has_one_section_per_subsystem_and_unique_flags():
    cfg = ServerConfig.of(model="m", port=9000, block_size=32, faiss_threads=2, packed_linear=False)
    assert set(SECTIONS) == {"http", "compute", "paths", "embed", "decode", "index"}
    assert (cfg.http.port, cfg.decode.block_size, cfg.index.faiss_threads, cfg.paths.packed_linear) == \
        (9000, 32, 2, False)
    assert cfg.embed.max_batch_tokens == 4096 and cfg.decode.max_num_batched_tokens == 512    # the CPU defaults
    flat = cfg.flat()
    assert ServerConfig.of(**flat).flat() == flat
    assert len(flat) == len(config_fields())
    with pytest.raises(TypeError, match="no configuration field"):
        ServerConfig.of(no_such_flag=1)
    for f in config_fields():                                  # every default passes its own checks
        d = field_default(f)
        assert d is None or not isinstance(d, float) or math.isfinite(d)
    with pytest.raises(ConfigError, match="without chunked prefill"):
        ServerConfig.of(enable_chunked_prefill=False, max_model_len=1024, max_num_batched_tokens=512)


def test_the_flag_reference_in_docs_is_generated_from_the_tree():
    from pathlib import Path

    from embedserve.config import reference_markdown
    doc = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert doc.read_text(encoding="utf-8").strip() == reference_markdown().strip(), \
        "docs/configuration.md is stale: run `python -m embedserve.config > docs/configuration.md`"
    for f in config_fields():
        assert f"`{flag(f.name)}`" in doc.read_text(encoding="utf-8")
