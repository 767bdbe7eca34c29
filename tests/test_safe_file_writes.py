"""Files are written safely: atomically (O_EXCL, never through a planted link, nothing left on a
failure), and a cached schema of the wrong shape is rebuilt (issue 39, S2, D6)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from centroidkv import schema
from centroidkv.files import replaced_atomically, write_atomic

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ S2. atomic writes, O_EXCL
@pytest.fixture
def schema_cache(tmp_path, monkeypatch):
    """An empty cache folder, and config_schema reading it as a fresh process would (the registry not
    yet imported; the schema it builds is today's)."""
    built = schema.build_schema()
    monkeypatch.setenv("CENTROIDKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.delitem(sys.modules, "centroidkv.methods")
    monkeypatch.setattr(schema, "build_schema", lambda: built)
    (tmp_path / "cache").mkdir()
    return built


def test_the_schema_write_never_follows_a_planted_link(tmp_path, schema_cache):
    """Before: the temporary file was `config_schema.json.<pid>.tmp`, written through a link planted
    at that name: the victim file was overwritten with the schema."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path = schema.schema_path()
    path.with_name(f"{path.name}.{os.getpid()}.tmp").symlink_to(victim)
    assert schema.config_schema() == schema_cache
    assert victim.read_text() == "precious\n"
    assert json.loads(path.read_text())["schema"] == schema_cache


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "table.tex"
    write_atomic(path, "old\n")
    with pytest.raises(RuntimeError), replaced_atomically(path) as temporary:
        temporary.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.tex"]
    assert oct(path.stat().st_mode & 0o777) == "0o644"


# ------------------------------------------------------------------ D6. a cached schema that does not validate
@pytest.mark.parametrize("bad", [{}, {"models": [], "methods": {"full": {}}}, [], "schema"])
def test_a_cached_schema_with_the_right_fingerprint_but_the_wrong_shape_is_rebuilt(schema_cache, bad):
    """Before: `"schema": {}` gave `KeyError: 'models'` on every call until deleted by hand."""
    path = schema.schema_path()
    path.write_text(json.dumps({"fingerprint": schema.fingerprint(), "schema": bad}))
    assert schema.config_schema() == schema_cache
    assert json.loads(path.read_text())["schema"] == schema_cache  # healed on disk too
