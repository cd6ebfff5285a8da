"""Interoperability of our inbound listener (15008) with clients we did not write.

Node.js's `http2` module as an HBONE client:
it makes the mTLS connection with a certificate from the fake CA and sends its own CONNECT
requests; our server must answer with the reference's statuses: 200 (and carry bytes), 400 for a
non-CONNECT method and for an authority that is not ours, 401 when policy denies the identity, 503 for
an illegal port and for a port where nothing listens. `openssl s_client`: TLS 1.3 with ALPN h2, and
the leaf the server presents carries exactly its workload's SPIFFE identity and chains to the root.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hbone.identity import Identity
from tests.apps import ONLY_FRONTEND, loopback_net, openssl_s_client, start_echo, workload_yaml
from tests.harness import Fleet, Proxy, proxy_env
from tests.netns import require_tools
from tests.waiting import eventually_async
from ztunnel.identity.certificates import FakeCA

pytestmark = pytest.mark.interop

NET = loopback_net()
SERVER = f"{NET}.3"
OTHER = f"{NET}.7"

CONFIG = f"""
workloads:{workload_yaml("server", SERVER, uid="i//v1/Pod")}{workload_yaml("other", OTHER, uid="i//v1/Pod")}{ONLY_FRONTEND}"""

NODE_CLIENT = r"""
const http2 = require('http2');
const fs = require('fs');
const [url, certDir, casesJson] = process.argv.slice(2);
const cases = JSON.parse(casesJson);
function tls(name) {
  return {
    key: fs.readFileSync(`${certDir}/${name}.key`),
    cert: fs.readFileSync(`${certDir}/${name}.crt`),
    ca: fs.readFileSync(`${certDir}/root.crt`),
    checkServerIdentity: () => undefined,
  };
}
function run(c) {
  return new Promise((resolve) => {
    const session = http2.connect(url, tls(c.identity));
    session.on('error', (e) => resolve({ name: c.name, error: String(e) }));
    const headers = { ':method': c.method, ':authority': c.authority };
    if (c.method !== 'CONNECT') { headers[':path'] = '/'; headers[':scheme'] = 'https'; }
    const req = session.request(headers, c.method === 'CONNECT' ? {} : { endStream: true });
    let status = null, body = '';
    req.on('response', (h) => {
      status = h[':status'];
      if (status === 200 && c.send) { req.end(c.send); }
    });
    req.setEncoding('utf8');
    req.on('data', (d) => { body += d; });
    req.on('end', () => { session.close(); resolve({ name: c.name, status, body }); });
    req.on('error', (e) => { session.close(); resolve({ name: c.name, status, error: String(e) }); });
  });
}
(async () => {
  const results = [];
  for (const c of cases) results.push(await run(c));
  console.log(JSON.stringify(results));
})();
"""


@pytest.fixture(scope="module")
def server_proxy(module_fleet: Fleet) -> Proxy:
    """A `ztunnel proxy` process, started once for the module."""
    [proxy] = module_fleet.start_all(proxy_env(SERVER, "demo/server/server", CONFIG))
    return proxy


@pytest.fixture
async def server(server_proxy: Proxy) -> AsyncIterator[Proxy]:
    echo = await start_echo(SERVER, 8080)
    try:
        server_proxy.mark()
        yield server_proxy
    finally:
        echo.server.close()


def write_certs(directory: Path) -> None:
    ca = FakeCA()
    (directory / "root.crt").write_bytes(ca.root_pem)
    for sa in ("frontend", "intruder"):
        cert = ca.issue(Identity("cluster.local", "demo", sa))
        (directory / f"{sa}.crt").write_bytes(b"".join(cert.chain_pem))
        (directory / f"{sa}.key").write_bytes(cert.key_pem)


async def test_node_http2_client_gets_the_reference_statuses(server: Proxy, tmp_path: Path) -> None:
    [node] = require_tools("node")
    write_certs(tmp_path)
    script = tmp_path / "client.js"
    script.write_text(NODE_CLIENT)
    cases = [
        {
            "name": "allowed",
            "identity": "frontend",
            "method": "CONNECT",
            "authority": f"{SERVER}:8080",
            "send": "ping over node",
        },
        {"name": "not-connect", "identity": "frontend", "method": "GET", "authority": f"{SERVER}:8080"},
        {"name": "ip-mismatch", "identity": "frontend", "method": "CONNECT", "authority": f"{OTHER}:8080"},
        {"name": "denied", "identity": "intruder", "method": "CONNECT", "authority": f"{SERVER}:8080"},
        {"name": "illegal-port", "identity": "frontend", "method": "CONNECT", "authority": f"{SERVER}:15001"},
        {
            "name": "nothing-listening",
            "identity": "frontend",
            "method": "CONNECT",
            "authority": f"{SERVER}:8099",
        },
    ]
    proc = await asyncio.create_subprocess_exec(
        node,
        str(script),
        f"https://{SERVER}:15008",
        str(tmp_path),
        json.dumps(cases),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    results = {r["name"]: r for r in json.loads(out)}
    assert results["allowed"]["status"] == 200
    assert results["allowed"]["body"] == "ping over node"
    assert {name: results[name]["status"] for name in results if name != "allowed"} == {
        "not-connect": 400,
        "ip-mismatch": 400,
        "denied": 401,
        "illegal-port": 503,
        "nothing-listening": 503,
    }
    wanted = (
        f"ip mismatch: {SERVER} != {OTHER}",
        "connection closed due to policy rejection: allow policies exist, but none allowed",
        'src.identity="spiffe://cluster.local/ns/demo/sa/intruder"',
    )
    await eventually_async(
        lambda: all(text in server.log_since_mark() for text in wanted), "the access-log lines"
    )
    logs = server.log_since_mark()
    assert f"ip mismatch: {SERVER} != {OTHER}" in logs
    assert "connection closed due to policy rejection: allow policies exist, but none allowed" in logs
    assert 'src.identity="spiffe://cluster.local/ns/demo/sa/intruder"' in logs


async def test_openssl_s_client_sees_the_workload_identity(server: Proxy, tmp_path: Path) -> None:
    require_tools("openssl")
    write_certs(tmp_path)
    view = await openssl_s_client(
        f"{SERVER}:15008",
        str(tmp_path / "frontend.crt"),
        str(tmp_path / "frontend.key"),
        str(tmp_path / "root.crt"),
    )
    text = view.text
    assert "Protocol  : TLSv1.3" in text or "New, TLSv1.3" in text, text
    assert "ALPN protocol: h2" in text
    assert "Verify return code: 0 (ok)" in text
    assert view.leaf_sans == ["spiffe://cluster.local/ns/demo/sa/server"]
