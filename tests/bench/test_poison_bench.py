"""bench/poison.py's machinery on a real store: a post goes as the telemetry route stores it for
a runtime token (another token's runtime id refused, ids past the per-token cap refused, the
evidence stored with the poster's witness), and the camouflaged liar keeps the honest
per-layer agreement rate the outlier screen's plain families compare."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from controlplane.db import utcnow
from controlplane.deployments.service import get_deployment
from controlplane.runtimes.service import RuntimeCaps
from controlplane.runtimes.witnesses import witness_of
from controlplane.telemetry.models import ShadowSampleRow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def poison():
    spec = importlib.util.spec_from_file_location("bench_poison", ROOT / "bench" / "poison.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _post(poison, session, tokens, sim, seq: int, caps: RuntimeCaps) -> bool:
    signals, matched = poison.honest(16, np.random.default_rng(seq))
    deployment = get_deployment(session=session, name="poisoned")
    made = poison.batch("poisoned", sim, seq, signals, matched, utcnow().timestamp() - 60, 1.0,
                        1)
    return poison.post(session, deployment, tokens[sim.credential], made, caps=caps)


def test_post_refuses_other_tokens_ids_and_ids_past_the_cap(poison, session):
    honest = poison.Sim("honest-0", "honest-0", 16)
    impostor = poison.Sim("honest-0", "impostor", 16, "all_matched")
    sybils = [poison.Sim(f"sybil-{i}", "sybil", 16, "all_matched") for i in range(3)]
    tokens, _, _ = poison.setup(session, "poisoned", [honest, impostor, *sybils],
                                utcnow(), None, tuned=False)
    caps = RuntimeCaps(per_deployment=5000, per_token=1)

    assert _post(poison, session, tokens, honest, 1, caps)
    assert not _post(poison, session, tokens, impostor, 2, caps)  # 403: honest-0's id
    assert [_post(poison, session, tokens, sim, 3 + i, caps)
            for i, sim in enumerate(sybils)] == [True, False, False]  # 409 past the cap

    stored = set(session.execute(select(ShadowSampleRow.runtime_id, ShadowSampleRow.witness)))
    assert stored == {
        ("honest-0", witness_of(token_id=tokens["honest-0"], runtime_id="")),
        ("sybil-0", witness_of(token_id=tokens["sybil"], runtime_id=""))}


def test_camouflaged_liar_keeps_the_honest_agreement_rate(poison):
    rng = np.random.default_rng(7)
    _, honest = poison.honest(200_000, rng)
    signals, lying = poison.liar("camouflaged", 200_000, rng)
    np.testing.assert_allclose(honest.mean(axis=0), poison.AGREEMENT, atol=0.005)
    np.testing.assert_allclose(lying.mean(axis=0), poison.AGREEMENT, atol=0.005)
    # every mismatch sits below every match, layer by layer
    for j in range(len(poison.LAYERS)):
        assert signals[~lying[:, j], j].max() < signals[lying[:, j], j].min()
