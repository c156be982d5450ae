"""https:// instances behind a private CA, with and without a client certificate (mutual TLS), over real TLS on
loopback: the router trusts exactly what tls_ca_file names, presents tls_cert_file, and says so at start-up
when a file is wrong."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest

from client_helpers import wait_for
from fake_upstream import CHAT, Upstream, router_for
from warmroute.errors import UsageError
from warmroute.router.app import ROUTER
from warmroute.router.settings_load import load_settings

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A private CA; server certificates for 127.0.0.1 and for the name engines.test (only), and a client
    certificate, all signed by it."""
    d = tmp_path_factory.mktemp("pki")
    f = {n: d / f"{n}.pem" for n in ("ca", "ca_key", "server", "server_key", "client", "client_key")}
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=warmroute test CA",
            "-keyout", str(f["ca_key"]), "-out", str(f["ca"]))
    f["named"], f["named_key"] = d / "named.pem", d / "named_key.pem"
    for who, subject, ext in (("server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1"),
                              ("client", "/CN=warmroute", "extendedKeyUsage=clientAuth"),
                              ("named", "/CN=engines.test", "subjectAltName=DNS:engines.test")):
        csr, extfile = d / f"{who}.csr", d / f"{who}.ext"
        extfile.write_text(ext + "\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", str(f[f"{who}_key"]),
                "-out", str(csr))
        openssl("x509", "-req", "-in", str(csr), "-CA", str(f["ca"]), "-CAkey", str(f["ca_key"]),
                "-CAcreateserial", "-days", "1", "-extfile", str(extfile), "-out", str(f[who]))
    return f


def server_context(pki: dict[str, Path], require_client: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki["server"], pki["server_key"])
    if require_client:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki["ca"])
    return ctx


async def chat_through(router) -> tuple[int, str]:
    async with aiohttp.ClientSession() as client:
        async with client.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
            return resp.status, resp.headers.get("x-warmroute-instance", "")


async def test_private_ca_is_trusted_for_health_and_requests(pki):
    up = await Upstream("a").start(ssl_context=server_context(pki))
    router = await router_for(up, tls_ca_file=str(pki["ca"]))
    try:
        assert router.app[ROUTER].fleet.instances["a"].healthy  # the health check went over TLS
        assert await chat_through(router) == (200, "a")
        assert up.seen and up.seen[-1][1] == "/v1/chat/completions"
    finally:
        await router.stop()
        await up.stop()


async def test_without_the_ca_the_instance_is_not_trusted(pki):
    up = await Upstream("a").start(ssl_context=server_context(pki))
    router = await router_for(up)  # the system's CAs do not know the test CA
    try:
        await wait_for(lambda: not router.app[ROUTER].fleet.instances["a"].healthy)
        status, _ = await chat_through(router)
        assert status in (502, 503)
        assert not any(path == "/v1/chat/completions" for _, path, _, _ in up.seen)
    finally:
        await router.stop()
        await up.stop()


async def test_tls_verify_off_accepts_any_certificate(pki):
    up = await Upstream("a").start(ssl_context=server_context(pki))
    router = await router_for(up, tls_verify=False)
    try:
        assert await chat_through(router) == (200, "a")
    finally:
        await router.stop()
        await up.stop()


async def test_client_certificate_for_mutual_tls(pki):
    up = await Upstream("a").start(ssl_context=server_context(pki, require_client=True))
    with_cert = await router_for(up, tls_ca_file=str(pki["ca"]), tls_cert_file=str(pki["client"]),
                                 tls_key_file=str(pki["client_key"]))
    without = await router_for(up, tls_ca_file=str(pki["ca"]))
    try:
        assert await chat_through(with_cert) == (200, "a")
        status, _ = await chat_through(without)
        assert status in (502, 503)
    finally:
        await with_cert.stop()
        await without.stop()
        await up.stop()


@pytest.mark.parametrize("overrides, message", [
    ({"tls_ca_file": "/no/such/ca.pem"}, "invalid setting tls_ca_file (--tls-ca-file): cannot load it"),
    ({"tls_cert_file": "CERT"}, "tls_cert_file and tls_key_file (--tls-key-file) go together"),
    ({"tls_cert_file": "CERT", "tls_key_file": "CA"}, "invalid setting tls_cert_file (--tls-cert-file): cannot load"),
])
def test_bad_tls_files_stop_start_up_with_one_line(pki, overrides, message):
    values = {k: str(pki["client"]) if v == "CERT" else str(pki["ca"]) if v == "CA" else v for k, v in overrides.items()}
    with pytest.raises(UsageError) as err:
        load_settings({"backends": ["https://127.0.0.1:1"], **values}, env={})
    assert message in str(err.value) and "\n" not in str(err.value)


async def test_dns_expanded_https_instances_verify_the_host_name_not_the_address(pki):
    """Issue #22 item 11: with dns_refresh_interval on, https://engines.test becomes one instance per address;
    TLS must still send engines.test as SNI and check the certificate against it (it has no IP name), and the
    instance must see Host: engines.test, on the proxied path and the control plane's health checks alike."""
    from aiohttp.test_utils import TestServer

    from warmroute.router.app import build_app

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki["named"], pki["named_key"])
    up = await Upstream("a").start(ssl_context=ctx)

    async def resolver(host: str, port: int) -> list[str]:
        assert host == "engines.test"
        return ["127.0.0.1"]

    settings = load_settings({"backends": [f"pool=https://engines.test:{up.port}"], "port": 0,
                              "dns_refresh_interval": 60, "tls_ca_file": str(pki["ca"]), "health_interval": 3600,
                              "engine_metrics": False, "models_interval": 0}, env={})
    server = TestServer(build_app(settings, resolver=resolver), host="127.0.0.1")
    await server.start_server()
    try:
        assert server.app[ROUTER].fleet.instances["pool"].healthy  # the health check's TLS checked the name
        async with aiohttp.ClientSession() as client:
            async with client.post(str(server.make_url("/v1/chat/completions")), json=CHAT) as r:
                assert r.status == 200 and r.headers["x-warmroute-instance"] == "pool"
        assert up.seen[-1][1] == "/v1/chat/completions"
        assert up.seen[-1][2]["Host"] == f"engines.test:{up.port}"
    finally:
        await server.close()
        await up.stop()
