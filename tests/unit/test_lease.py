"""The run's liveness lease: the pure decision, and the lease file a driver writes, renews and
releases, on a local folder."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from tests.conftest import REPO
from tests.helpers.waiting import wait_for
from wildtrain import lease
from wildtrain.clusters import registry
from wildtrain.clusters.submit import job_spec, refuse_live
from wildtrain.config import ConfigError, load_config
from wildtrain.layout import RunLayout
from wildtrain.lease import Holder, Keeper, Lease, LeaseError, decide

OTHER = Holder("head-node", 4242, "a", "t-other", "wildtrain-r-0123abcd")


def _lease(renewed_at: float, expires_at: float, released_at: float | None = None) -> Lease:
    return Lease(OTHER, renewed_at, expires_at, released_at)


def test_a_live_lease_of_another_driver_refuses_naming_the_holder_and_expiry():
    verdict = decide("r", _lease(1000.0, 1090.0), now=1030.0)
    assert not verdict.free
    assert "\n" not in verdict.why
    assert verdict.why.startswith("run 'r' is live: pid 4242 on head-node (cluster a, job wildtrain-r-0123abcd)")
    assert time.strftime("%H:%M:%S UTC", time.gmtime(1090.0)) in verdict.why and "renewed 30 s ago" in verdict.why


@pytest.mark.parametrize(
    "held, now, token",
    [
        (None, 1030.0, None),  # never leased
        (_lease(1000.0, 1090.0, released_at=1050.0), 1060.0, None),  # its driver ended
        (_lease(1000.0, 1090.0), 1090.0, None),  # expired: its driver died
        (_lease(1000.0, 1090.0), 1030.0, "t-other"),  # the holder asking about its own lease
    ],
)
def test_no_lease_a_released_an_expired_and_ones_own_lease_are_free(held, now, token):
    assert decide("r", held, now, token).free


def test_the_lease_file_round_trips():
    assert Lease.from_json(_lease(1.0, 2.0).to_json()) == _lease(1.0, 2.0)


def _cfg(tmp_path, *extra: str):
    return load_config([f"run.storage={tmp_path}", "run.name=r", "cluster.name=a", *extra])


def _uri(cfg) -> str:
    return RunLayout.of(cfg.run, cfg.checkpoint).lease


def _keeper(cfg, uri=None) -> Keeper:
    return Keeper(cfg.run, cfg.cluster.name, cfg.storage, uri or _uri(cfg))


def _read(cfg) -> Lease:
    with open(_uri(cfg)) as f:
        return Lease.from_json(f.read())


def test_a_driver_writes_renews_and_releases_its_lease(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    cfg = _cfg(tmp_path, "run.lease_renew_s=0.05", "run.lease_expire_s=0.5")
    keeper = _keeper(cfg)
    with keeper:
        assert not os.path.exists(_uri(cfg))  # checked, not yet taken
        keeper.acquire()
        first = _read(cfg)
        assert (first.holder.host, first.holder.pid, first.holder.cluster) == (socket.gethostname(), os.getpid(), "a")
        assert first.released_at is None and first.expires_at == pytest.approx(first.renewed_at + 0.5)
        renewed = wait_for(lambda: (now := _read(cfg)).renewed_at > first.renewed_at and now, "a renewal")
        assert renewed.holder == first.holder and renewed.expires_at == pytest.approx(renewed.renewed_at + 0.5)
    released = _read(cfg)
    assert released.holder == first.holder and released.released_at is not None
    assert lease.check("r", _uri(cfg), cfg.storage).free


def test_a_second_driver_is_refused_while_the_first_holds_the_lease_and_not_after_it_expires(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    cfg = _cfg(tmp_path, "run.lease_renew_s=0.05", "run.lease_expire_s=1")
    first = _keeper(cfg)
    first.acquire()
    with pytest.raises(LeaseError, match=rf"^run 'r' is live: pid {os.getpid()} on .* holds its lease until"):
        with _keeper(cfg):
            pass
    # The first driver dies: nothing renews, nothing releases.
    first._stop.set()
    first._thread.join()
    wait_for(lambda: lease.check("r", _uri(cfg), cfg.storage).free, "the lease's expiry")
    second = _keeper(cfg)
    with second:
        second.acquire()
        assert _read(cfg).holder == second.holder
    # The dead driver's late release (or renewal) must not touch the new holder's lease.
    assert not lease.release_for(_uri(cfg), cfg.storage, first.holder)


def test_a_driver_that_lost_its_lease_stops_renewing_rather_than_take_it_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    cfg = _cfg(tmp_path, "run.lease_renew_s=0.05", "run.lease_expire_s=0.3")
    uri = _uri(cfg)
    keeper = _keeper(cfg, uri)
    keeper.acquire()
    taken = Lease(OTHER, time.time(), time.time() + 60)
    with open(uri, "w") as f:
        f.write(taken.to_json())
    keeper._thread.join(timeout=5)
    assert not keeper._thread.is_alive()
    assert "lost its lease to pid 4242 on head-node" in capsys.readouterr().out
    keeper.release()
    assert _read(cfg) == taken


def test_a_lease_file_that_does_not_parse_is_named(tmp_path):
    cfg = _cfg(tmp_path)
    uri = _uri(cfg)
    os.makedirs(os.path.dirname(uri))
    with open(uri, "w") as f:
        json.dump({"holder": "?"}, f)
    with pytest.raises(LeaseError, match=rf"^{uri}: not a lease"):
        _keeper(cfg, uri).acquire()


def test_a_lease_that_would_expire_between_renewals_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^run.lease_expire_s: must be above run.lease_renew_s \(30\)"):
        load_config(["run.lease_expire_s=30"])


def test_submit_refuses_a_run_live_on_the_cluster_and_names_its_job_in_the_job_env(tmp_path):
    cfg = _cfg(tmp_path)
    os.makedirs(RunLayout.of(cfg.run, cfg.checkpoint).root)
    with open(_uri(cfg), "w") as f:
        f.write(Lease(OTHER, time.time(), time.time() + 60).to_json())
    cluster = registry.load(REPO / "ray_clusters" / "clusters.yaml").get("local")
    with pytest.raises(LeaseError, match=r"^local: run 'r' is live: pid 4242 on head-node"):
        refuse_live(cluster, cfg)
    spec = job_spec(cluster, ["experiment=tiny"], working_dir=REPO)
    assert spec.runtime_env["env_vars"][lease.JOB_VARIABLE] == spec.submission_id


def test_of_two_drivers_that_take_the_lease_at_once_one_is_refused(tmp_path):
    # Both read no lease, both write within SETTLE_S: the read back settles who won.
    cfg = _cfg(tmp_path)
    keepers = [_keeper(cfg) for _ in range(2)]
    outcomes: list = [None, None]

    def take(i: int) -> None:
        try:
            keepers[i].acquire()
            outcomes[i] = "held"
        except LeaseError as e:
            outcomes[i] = str(e)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(o == "held" for o in outcomes) == [False, True]
    assert any(o.startswith("run 'r' is live: pid") for o in outcomes if o != "held")
    winner, loser = sorted(keepers, key=lambda k: outcomes[keepers.index(k)] != "held")
    loser.release()  # what it wrote was overwritten: the winner's lease stays live
    assert _read(cfg).holder == winner.holder and _read(cfg).released_at is None
    winner.release()
    assert _read(cfg).released_at is not None


def _registry(tmp_path):
    """Clusters a and b with their runs on local folders and no jobs API (nothing listens):
    a move that refuses must do so before it asks one."""
    import yaml

    from wildtrain.services import free_port

    entries = {
        name: {
            "provider": "local",
            "launcher": str(REPO / "ray_clusters/local-dev.yaml"),
            "jobs_api": f"http://127.0.0.1:{free_port()}",
            "token_file": "none.token",
            "storage": {"runs": str(tmp_path / name / "runs"), "data": str(tmp_path / name / "data")},
        }
        for name in ("a", "b")
    }
    path = tmp_path / "clusters.yaml"
    path.write_text(yaml.safe_dump({"clusters": entries}))
    return registry.load(path)


def test_move_refuses_a_run_live_on_its_cluster_that_no_job_of_it_holds_and_copies_nothing(tmp_path):
    from wildtrain.clusters.move import move

    clusters = _registry(tmp_path)
    root = tmp_path / "a" / "runs" / "r"
    root.mkdir(parents=True)
    (root / "wildtrain_run.json").write_text(json.dumps({"mlflow_run_id": "0123"}))
    head = Holder("head-node", 4242, "a", "t-head")  # `wildtrain train` on a's head: no job
    (root / "lease.json").write_text(Lease(head, time.time(), time.time() + 60).to_json())
    with pytest.raises(LeaseError, match=r"^a: run 'r' is live: pid 4242 on head-node \(cluster a\) holds its lease"):
        move("r", clusters.get("a"), clusters.get("b"), [])
    assert not (tmp_path / "b").exists()


def test_sync_leaves_the_lease_behind_so_a_copy_is_no_driver_s_and_a_renewal_fails_no_check(tmp_path):
    from wildtrain.clusters.sync import Location, sync

    src = tmp_path / "src"
    src.mkdir()
    (src / "wildtrain_run.json").write_text(json.dumps({"mlflow_run_id": "0123"}))
    (src / "lease.json").write_text(Lease(OTHER, time.time(), time.time() + 60).to_json())
    done = sync(Location(str(src)), Location(str(tmp_path / "dst")))
    assert done.copied == ("wildtrain_run.json",)
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["wildtrain_run.json"]


def test_the_lease_durations_change_no_trial_hash():
    from wildtrain.sweeps.grid import trial_hash

    timed = trial_hash(load_config(["run.lease_renew_s=5", "run.lease_expire_s=300"]))
    assert timed == trial_hash(load_config([])) != trial_hash(load_config(["train.steps=3"]))
