"""The router's services as components (started in order, stopped in reverse whatever fails, never hanging) and
membership as events (added / changed / removed) that each follower keeps up with on its own."""

from __future__ import annotations

import asyncio

import pytest

from fake_upstream import Upstream
from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.errors import UsageError
from warmroute.router import components
from warmroute.router.app import COMPONENTS, PROXY, ROUTER
from warmroute.router.components import Components, Periodic
from warmroute.router.discovery import ADMIN, CONFIG, Membership
from warmroute.router.health import HEALTH
from warmroute.router.members import Addresses, Member
from warmroute.router.server import start_router
from warmroute.router.settings import Backend
from warmroute.router.settings_load import load_settings


class Part:
    """A component that writes down what happened to it; it fails (or hangs) where told to."""

    def __init__(self, name: str, log: list[str], fail_start: bool = False, fail_stop: bool = False,
                 hang_stop: bool = False) -> None:
        self.name, self.log = name, log
        self.fail_start, self.fail_stop, self.hang_stop = fail_start, fail_stop, hang_stop

    async def start(self) -> None:
        self.log.append(f"start {self.name}")
        if self.fail_start:
            raise ConnectionRefusedError("connection refused\nand a second line nobody needs")

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")
        if self.hang_stop:
            await asyncio.Event().wait()
        if self.fail_stop:
            raise RuntimeError("could not close")


async def test_components_start_in_order_and_stop_in_reverse():
    log: list[str] = []
    parts = Components(Part(n, log) for n in ("a", "b", "c"))
    await parts.start()
    await parts.stop()
    assert log == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]
    await parts.stop()  # twice: nothing left to stop
    assert len(log) == 6


async def test_a_start_failure_stops_what_started_and_says_so_in_one_line():
    log: list[str] = []
    parts = Components([Part("a", log), Part("b", log, fail_start=True), Part("c", log)])
    with pytest.raises(UsageError) as err:
        await parts.start()
    assert str(err.value) == "cannot start b: ConnectionRefusedError: connection refused"
    assert log == ["start a", "start b", "stop b", "stop a"]  # c never started; b may have half started


async def test_stopping_goes_on_past_a_stop_that_fails_or_hangs(monkeypatch, caplog):
    monkeypatch.setattr(components, "STOP_TIMEOUT_S", 0.1)
    log: list[str] = []
    parts = Components([Part("a", log), Part("b", log, hang_stop=True), Part("c", log, fail_stop=True)])
    await parts.start()
    await asyncio.wait_for(parts.stop(), 5)
    assert log[3:] == ["stop c", "stop b", "stop a"]
    assert "stopping c failed: RuntimeError: could not close" in caplog.text
    assert "stopping b took over 0.1 s" in caplog.text


async def test_a_periodic_component_does_a_round_at_start_then_every_interval():
    class Counter(Periodic):
        name = "counter"

        def __init__(self) -> None:
            super().__init__(0.01)
            self.rounds = 0

        async def round(self) -> None:
            self.rounds += 1

    counter = Counter()
    await counter.start()
    assert counter.rounds == 1 and counter.running
    while counter.rounds < 3:
        await asyncio.sleep(0.01)
    await counter.stop()
    rounds = counter.rounds
    await asyncio.sleep(0.05)
    assert counter.rounds == rounds and not counter.running


# -- membership as events ---------------------------------------------------------------------------------------
class Recorder(Addresses):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def added(self, member: Member) -> None:
        super().added(member)
        self.events.append(("added", member.name))

    def changed(self, member: Member) -> None:
        super().changed(member)
        self.events.append(("changed", member.name))

    def removed(self, name: str) -> None:
        super().removed(name)
        self.events.append(("removed", name))


def test_membership_tells_each_follower_of_every_change():
    fleet = Fleet(FleetSettings())
    fleet.add("a")
    membership = Membership(fleet, [Backend(name="a", url="http://10.0.0.1:8000")], lambda b: False)
    early = Recorder()
    membership.subscribe(early)
    assert early.events == [("added", "a")]  # the instances already there, at subscription
    assert membership.add(Backend(name="b", url="http://10.0.0.2:8000"), ADMIN)
    assert not fleet.instances["b"].healthy  # the fleet follows first: no traffic before a health check
    assert membership.add(Backend(name="b", url="http://10.0.0.3:8000"), ADMIN)  # given again, moved
    assert not membership.add(Backend(name="a", url="http://10.0.0.9:8000"), ADMIN)  # another source's name
    late = Recorder()
    membership.subscribe(late)
    fleet.dispatched("b", 10)  # in flight: draining keeps it until it is done
    membership.drain("b")
    assert "b" in fleet.instances and early.events[-1] == ("changed", "b")
    fleet.finished("b", 10, True, (), 10)
    membership.reap()
    membership.reconcile(CONFIG, [])  # the config source lists nothing now: "a" drains, idle, so goes at once
    assert set(fleet.instances) == set()
    assert early.events == [("added", "a"), ("added", "b"), ("changed", "b"), ("removed", "b"), ("removed", "a")]
    assert late.events == [("added", "a"), ("added", "b"), ("removed", "b"), ("removed", "a")]
    assert early.urls == late.urls == {} and membership.urls == {}


async def test_the_router_s_followers_keep_their_own_addresses(up_a, up_b, client):
    router = await start_router(load_settings({"backends": [f"a={up_a.url}"], "port": 0, "health_interval": 3600,
                                               "admin_token": "t0ken"}, env={}))
    try:
        auth = {"Authorization": "Bearer t0ken"}
        async with client.post(router.url + "/admin/instances", json={"name": "b", "url": up_b.url},
                               headers=auth) as r:
            assert r.status == 201 and (await r.json())["healthy"]  # checked before the answer
        proxy, health = router.app[PROXY], router.app[HEALTH]
        assert proxy.urls == health.urls == {"a": up_a.url, "b": up_b.url}
        assert proxy.urls is not health.urls
        async with client.delete(router.url + "/admin/instances/b", headers=auth) as r:
            assert r.status == 200
        assert proxy.urls == health.urls == {"a": up_a.url}
        assert set(router.app[ROUTER].fleet.instances) == {"a"}
        assert router.app[COMPONENTS].names == ["upstream connections", "discovery", "health", "dashboard-timeline",
                                                "models", "engine-metrics"]
    finally:
        await router.stop()


# -- a component that cannot start ------------------------------------------------------------------------------
def _warmroute_tasks() -> list[str]:
    return sorted(t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("warmroute-"))


async def test_a_router_whose_component_cannot_start_stops_the_rest(tmp_path, monkeypatch):
    pytest.importorskip("kubernetes_asyncio")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))  # no cluster to watch
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    up = await Upstream("a", ("m",)).start()
    try:
        with pytest.raises(UsageError) as err:  # after the discovery loops and the connections started
            await start_router(load_settings({"backends": [f"a={up.url}"], "kubernetes_service": "llm/vllm",
                                              "port": 0, "dns_refresh_interval": 5}, env={}))
        assert str(err.value).startswith("cannot start kubernetes: ") and "\n" not in str(err.value)
        assert _warmroute_tasks() == []  # the discovery loops it had started are stopped
    finally:
        await up.stop()


def test_the_cli_says_a_start_failure_in_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("kubernetes_asyncio")
    from warmroute.cli import main

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["serve", "--kubernetes-service", "llm/vllm", "--port", "0", "--host", "127.0.0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("warmroute serve: error: cannot start kubernetes: "), err
