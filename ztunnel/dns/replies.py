"""The DNS proxy's reply messages (dnspython): a reply to a query with its EDNS echoed, and the
records of a `resolver.Authoritative` answer (TTL 30, AA and RA set, a CNAME to the stripped name).
"""

from __future__ import annotations

from typing import Final

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from mesh.model import Workload
from ztunnel.dns.resolver import Authoritative, ResolverSettings, resolve
from ztunnel.state.store import ProxyState

TTL: Final = 30
MIN_UDP_PAYLOAD: Final = 512


def question_name(query: dns.message.Message) -> str:
    return query.question[0].name.to_text(omit_final_dot=True).lower()


def response_for(
    query: dns.message.Message, rcode: dns.rcode.Rcode, *, authoritative: bool = False
) -> dns.message.Message:
    """A reply to `query` with RA set and its EDNS echoed (version, DO bit, payload of at least 512)."""
    response = dns.message.make_response(query, recursion_available=True)
    if authoritative:
        response.flags |= dns.flags.AA
    response.set_rcode(rcode)
    if query.edns >= 0:
        response.use_edns(
            query.edns, query.ednsflags & dns.flags.DO, payload=max(query.payload, MIN_UDP_PAYLOAD)
        )
    return response


def authoritative_response(query: dns.message.Message, result: Authoritative) -> dns.message.Message:
    """The reply message of `result`: TTL 30 on every record, AA and RA set."""
    response = response_for(query, dns.rcode.NOERROR, authoritative=True)
    if not result.addresses:
        return response
    qname = query.question[0].name
    rdtype = query.question[0].rdtype
    owner = qname
    if result.owner != result.name:
        owner = dns.name.from_text(result.owner)
        response.answer.append(
            dns.rrset.from_text(qname, TTL, dns.rdataclass.IN, dns.rdatatype.CNAME, owner.to_text())
        )
    response.answer.append(
        dns.rrset.from_text_list(owner, TTL, dns.rdataclass.IN, rdtype, [str(ip) for ip in result.addresses])
    )
    return response


def answer(
    state: ProxyState, client: Workload, query: dns.message.Message, settings: ResolverSettings
) -> dns.message.Message | None:
    """The reply to a well-formed query with one IN question, or None when it is to be forwarded."""
    q = query.question[0]
    if q.rdclass != dns.rdataclass.IN:
        return None
    result = resolve(state, client, question_name(query), q.rdtype, settings)
    if not isinstance(result, Authoritative):
        return None
    return authoritative_response(query, result)
