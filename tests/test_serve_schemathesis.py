"""Schemathesis (its CLI, unmodified) fuzzes a live `k3 serve` from the server's own /openapi.json, with the API
key: schema-valid and schema-invalid requests for every documented operation, then its stateful phase. Every
check must pass (no response >= 500, every response and status code as documented, invalid data refused, auth
enforced, Allow headers right) except `positive_data_acceptance`: the schema gives types and bounds, while some
rules are semantic and a 400 by design (a chat role, a token id inside the vocabulary, one of prompt/messages).
The HAR report gives every request made; the run is bounded (examples per operation, a short --max-model-len;
responses may take 30 s rather than schemathesis's 10: a chat of 60 tokens on a shared CPU core)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from live_serve import k3_serve, save_tiny_model
from schemathesis_hooks import MODEL

KEY = "sk-schemathesis-test"
TESTS = Path(__file__).resolve().parent


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_nor_schema_violation(tmp_path):
    save_tiny_model(tmp_path / "model")
    har = tmp_path / "requests.har"
    schemathesis = Path(sys.executable).parent / "schemathesis"
    with k3_serve(tmp_path / "model", KEY, MODEL, tmp_path / "serve.log", "--max-model-len", "64") as url:
        import subprocess

        run = subprocess.run(
            [str(schemathesis), "run", f"{url}/openapi.json", "--header", f"Authorization: Bearer {KEY}",
             "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-examples", "10", "--seed", "19",
             "--workers", "1", "--request-timeout", "60", "--max-response-time", "30",
             "--report", "har", "--report-har-path", str(har), "--output-truncate", "true"],
            env={**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
                 "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])},
            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    statuses = [(e["request"]["method"], e["request"]["url"].removeprefix(url), e["response"]["status"])
                for e in entries]
    documented = [s for s in statuses if s[0] in ("GET", "POST")]
    codes = sorted({s for *_, s in statuses})
    print(f"\nschemathesis: {len(statuses)} requests ({len(documented)} GET/POST), "
          f"{sum(s >= 500 for *_, s in statuses)} responses >= 500; by status: "
          + ", ".join(f"{c}: {sum(s == c for *_, s in statuses)}" for c in codes))
    assert len(statuses) > 500
    assert [s for s in statuses if s[2] >= 500] == []
    # the fuzzer got past validation into generation on both generating routes (the hooks name the served model)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert any(p == path and s == 200 for _, p, s in statuses), path
    assert any(s == 401 for *_, s in statuses)  # ignored_auth: requests without the key were made and refused
