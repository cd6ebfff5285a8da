"""The generated protocol code is what `python -m xds.generate` makes from `xds/proto` today."""

from google.protobuf import any_pb2

from xds import generate
from xds.gen.istio.security import authorization_pb2
from xds.gen.istio.workload import workload_pb2


def test_generated_code_is_not_stale() -> None:
    assert generate.main(["--check"]) == 0, "run `python -m xds.generate` and commit xds/gen"


def test_type_urls_are_istios() -> None:
    a = any_pb2.Any()
    a.Pack(workload_pb2.Address())
    assert a.type_url == "type.googleapis.com/istio.workload.Address"
    a.Pack(authorization_pb2.Authorization())
    assert a.type_url == "type.googleapis.com/istio.security.Authorization"


def test_field_numbers_of_the_wire() -> None:
    w = workload_pb2.Workload.DESCRIPTOR.fields_by_name
    assert (w["uid"].number, w["services"].number, w["capacity"].number, w["application_tunnel"].number) == (
        20,
        22,
        27,
        23,
    )
    clause = authorization_pb2.Clause.DESCRIPTOR.fields_by_name
    assert clause["matches"].number == 2
