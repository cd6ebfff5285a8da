"""The mesh `python -m benches scale` serves: N workloads, N/10 services (each workload in one), N/100
policies, written in the local-config format the development control plane reads.

Besides the bulk, two workloads of the harness's own: the proxy's (`scale/proxy`, at the proxy's
address) and the probe's: a plain-TCP workload at the sink's address, the only endpoint of the
probe service (`240.255.0.1:80`). A connection through the proxy to that VIP reaches the sink only
once the proxy knows the service and its endpoint (an unknown VIP goes nowhere), so the probe says
when the mesh is routable; a push moves the probe's target port, so the probe says when a push is
applied (the sink answers with the port it was reached on).
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_VIP = "240.255.0.1"
PROBE_PORT = 80
PROXY_WORKLOAD = ("scale", "proxy", "proxy")  # namespace, name, service account
PER_SERVICE = 10  # workloads per service
PER_POLICY = 100  # workloads per policy (one policy per namespace of 100 workloads)


def _ip(prefix: int, i: int) -> str:
    return f"{prefix}.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"


def _service_host(i: int) -> str:
    ns = f"ns{i // PER_POLICY}"
    return f"svc{i // PER_SERVICE}.{ns}.svc.cluster.local"


@dataclass(frozen=True)
class ScaleMesh:
    workloads: int
    proxy_ip: str
    sink_ip: str
    sink_ports: tuple[int, int]  # before and after the push

    @property
    def total_workloads(self) -> int:
        """Every workload the proxy should hold: the bulk, the proxy's own and the probe."""
        return self.workloads + 2

    @property
    def services(self) -> int:
        return -(-self.workloads // PER_SERVICE)

    @property
    def policies(self) -> int:
        return -(-self.workloads // PER_POLICY)

    def pushed(self, percent: float) -> list[int]:
        """The bulk workloads a push of `percent` % changes (spread over the mesh)."""
        count = max(1, round(self.workloads * percent / 100))
        step = max(1, self.workloads // count)
        return list(range(0, self.workloads, step))[:count]

    def render(
        self, revision: str = "v1", changed: frozenset[int] = frozenset(), pushed: bool = False
    ) -> str:
        """The YAML: `changed` bulk workloads carry `revision`, the others v1; `pushed` moves the
        probe to the sink's second port."""
        out = ["workloads:"]
        append = out.append
        for i in range(self.workloads):
            ns = f"ns{i // PER_POLICY}"
            rev = revision if i in changed else "v1"
            append(
                f"  - {{uid: 'Kubernetes//Pod/{ns}/w{i}', name: w{i}, namespace: {ns}, "
                f"serviceAccount: sa{i % 10}, trustDomain: cluster.local, workloadIps: ['{_ip(10, i)}'], "
                f"protocol: HBONE, node: node{i % 50}, canonicalName: app{i // PER_SERVICE}, "
                f"canonicalRevision: {rev}, workloadName: app{i // PER_SERVICE}, workloadType: deployment, "
                f"clusterId: Kubernetes, services: {{'{ns}/{_service_host(i)}': {{80: 8080}}}}}}"
            )
        ns, name, sa = PROXY_WORKLOAD
        append(
            f"  - {{uid: 'Kubernetes//Pod/{ns}/{name}', name: {name}, namespace: {ns}, serviceAccount: {sa}, "
            f"trustDomain: cluster.local, workloadIps: ['{self.proxy_ip}'], protocol: HBONE, "
            f"clusterId: Kubernetes}}"
        )
        target = self.sink_ports[1 if pushed else 0]
        append(
            "  - {uid: 'Kubernetes//Pod/scale/probe', name: probe, namespace: scale, serviceAccount: probe, "
            f"trustDomain: cluster.local, workloadIps: ['{self.sink_ip}'], protocol: TCP, "
            f"clusterId: Kubernetes, services: {{'scale/probe.scale.svc.cluster.local': "
            f"{{{PROBE_PORT}: {target}}}}}}}"
        )
        out.append("services:")
        for j in range(self.services):
            ns = f"ns{j * PER_SERVICE // PER_POLICY}"
            append(
                f"  - {{name: svc{j}, namespace: {ns}, hostname: {_service_host(j * PER_SERVICE)}, "
                f"vips: ['/{_ip(11, j)}'], ports: {{80: 8080}}}}"
            )
        append(
            "  - {name: probe, namespace: scale, hostname: probe.scale.svc.cluster.local, "
            f"vips: ['/{PROBE_VIP}'], ports: {{{PROBE_PORT}: 0}}}}"
        )
        out.append("policies:")
        for k in range(self.policies):
            append(
                f"  - {{name: allow-own-{k}, namespace: ns{k}, scope: Namespace, action: Allow, dryRun: false, "
                f"rules: [[[{{principals: [!Prefix 'cluster.local/ns/ns{k}/']}}]]]}}"
            )
        return "\n".join(out) + "\n"
