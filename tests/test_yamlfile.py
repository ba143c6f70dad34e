"""hsched.yamlfile, the one YAML loader every file reader uses: through each reader's command, a deeply nested
file, a repeated key, a value PyYAML cannot make and a file that is not UTF-8 are one line naming the file (they
were a RecursionError or UnicodeDecodeError traceback, or the last key silently won); and each reader's reading of
numbers (YAML 1.2/JSON, or YAML 1.1 where every value is a string)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hsched import cli, yamlfile
from hsched.deploy import k8s
from hsched.domain.errors import FleetError, ValidationError
from hsched.domain.fleet import load_fleet
from hsched.engine.slices import FORMAT, SliceCatalog
from hsched.policies.fairshare import TenantWeights
from hsched.security import tokens
from services.placer.server import main as placer_main

SMALL_FLEET = Path(__file__).resolve().parent / "fleets" / "small.yaml"
UNREACHABLE = "127.0.0.1:1"

BAD_FILES = {  # what each is refused with
    "deep": ("a: " + "[" * 10_000 + "]" * 10_000 + "\n", "nests deeper than 32 levels (line 1)"),
    "duplicate": ("version: 1\nname: x\nversion: 1\n", "duplicate key 'version' on line 3 (first on line 1)"),
    "bad value": ("version: 1\nwhen: 2020-13-45\n", "'2020-13-45' on line 2 is not a valid timestamp"),
    "not utf-8": (b"version: 1\n\xff\n", "is not UTF-8 text (byte 11)"),
}

# every command reading a YAML file of its own kind, the file's path in place of {}
COMMANDS = {
    "task file": ["submit", "-f", "{}", "--gateway", UNREACHABLE],
    "fleet": ["k8s", "render", "--fleet", "{}"],
    "slice types": ["slices", "show", "{}"],
    "up's slice types": ["up", "--slice-types", "{}"],
    "tokens": ["tokens", "list", "--file", "{}"],
}


def write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("kind", BAD_FILES)
@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_refuses_a_bad_file_in_one_line_naming_it(command, kind, tmp_path, capsys, private_runtime_dir):
    content, words = BAD_FILES[kind]
    path = write(tmp_path / "bad.yaml", content)
    assert cli.main([str(path) if a == "{}" else a for a in COMMANDS[command]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and words in err, err


@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_placers_tenant_weights_file_is_a_usage_error_naming_it(kind, tmp_path, capsys):
    content, words = BAD_FILES[kind]
    path = write(tmp_path / "weights.yaml", content)
    with pytest.raises(SystemExit) as exit_:
        placer_main(["--datacenter", "cheap", "--tenant-weights", str(path)])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage lines come first
    assert f"--tenant-weights {path}: {words}" in last, last


@pytest.mark.parametrize("kind", BAD_FILES)
def test_the_library_readers_raise_their_own_error_type(kind, tmp_path):
    content, words = BAD_FILES[kind]
    path = write(tmp_path / "bad.yaml", content)
    with pytest.raises(FleetError) as fleet:  # the CLI adds the file: `--fleet PATH: <yaml>: ...`
        load_fleet(path)
    assert fleet.value.field == "<yaml>" and words in fleet.value.rule
    with pytest.raises(tokens.TokensFileError) as tok:
        tokens.load_tokens(path)
    assert str(tok.value).startswith(f"{path}: ") and words in str(tok.value)
    with pytest.raises(ValidationError) as slices:
        SliceCatalog.load(path)
    assert str(slices.value).startswith(f"{path}: ") and words in str(slices.value)


@pytest.mark.parametrize("kind", ["deep", "duplicate", "bad value"])
def test_k8s_render_reads_the_fleet_text_with_the_same_loader(kind):
    text, words = BAD_FILES[kind]
    with pytest.raises(ValidationError) as info:
        k8s.render(load_fleet(SMALL_FLEET), text, k8s.Options(), "--fleet f.yaml")
    assert str(info.value).startswith("--fleet f.yaml: ") and words in str(info.value)


def test_several_documents_where_one_is_read_are_refused(tmp_path):
    path = write(tmp_path / "t.yaml", "version: 1\n---\nversion: 1\n")
    with pytest.raises(tokens.TokensFileError, match="t.yaml: holds several YAML documents"):
        tokens.load_tokens(path)
    assert yamlfile.document("---\na: 1\n---\n", "x") == {"a": 1}  # an empty document is no document


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from([*"[]{}:,-? &*!'\"#\n\t|>%@`ab1e.", "\x01", "é", "\ufeff"]),
               max_size=60))
def test_any_text_is_read_or_refused_naming_the_file(text):
    for json_numbers in (True, False):
        try:
            yamlfile.documents(text, "f.yaml", json_numbers=json_numbers)
        except yamlfile.YamlFileError as exc:
            assert exc.field == "f.yaml" and "\n" not in str(exc), str(exc)


_TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Cn")), max_size=8)  # what YAML may hold raw
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | _TEXT | st.floats(allow_nan=False, allow_infinity=False),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_json_and_yaml_dumper_output_reads_back_as_written(value):
    """Numbers as JSON reads them (json.dumps(1e-06) is `1e-06`, a string to YAML 1.1), and YamlDumper quotes a
    string such as `1e5` that would read back as a number."""
    # ensure_ascii=False: PyYAML reads JSON's surrogate pair escapes (of a character beyond U+FFFF) as two characters
    assert yamlfile.document(json.dumps(value, ensure_ascii=False), "f.json") == value
    assert yamlfile.document(yaml.dump(value, Dumper=yamlfile.YamlDumper), "f.yaml") == value


def test_slice_types_json_with_a_tiny_share_loads(tmp_path):
    """A behaviour change: save() writes a share of 1e-06 as `1e-06` in JSON, which YAML 1.1 read as a string
    ('must be a finite number'); it is the number it was."""
    catalog = SliceCatalog.from_dict({"format": FORMAT, "types": [{"cpu_milli": 1000, "memory_mib": 1024, "share": 1e-6},
                                                                  {"cpu_milli": 2000, "memory_mib": 4096, "share": 1}]})
    for name in ("s.json", "s.yaml"):
        catalog.save(tmp_path / name)
        assert SliceCatalog.load(tmp_path / name).shares == (1e-6, 1.0)


def test_a_fleet_reads_exponent_numbers_as_numbers(tmp_path):
    """A behaviour change: `1e-2` (no dot) was the string '1e-2' to YAML 1.1 ('must be a finite number')."""
    path = write(tmp_path / "f.yaml", SMALL_FLEET.read_text().replace("network_price_per_gb_ms: 0.01",
                                                                      "network_price_per_gb_ms: 1e-2"))
    assert math.isclose(load_fleet(path).network_price_per_gb_ms, 0.01)


def test_tokens_and_weights_keep_names_such_as_1e5_strings(tmp_path):
    """Their values are names (written unquoted by yaml.safe_dump): YAML 1.1 numbers, so `1e5` stays a name."""
    path = tmp_path / "tokens.yaml"
    tokens.create_token(path, tenant="1e5", name="2e10")
    assert "name: 2e10" in path.read_text()  # safe_dump wrote it bare
    (entry,) = tokens.load_tokens(path)
    assert (entry.name, entry.tenant) == ("2e10", "1e5")
    weights = write(tmp_path / "w.yaml", "1e5: 2\n")
    assert TenantWeights.parse(str(weights)).of("1e5") == 2.0
