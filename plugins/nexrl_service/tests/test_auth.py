"""API keys: a configured key is compared exactly; without one the protocol's prefix
rule applies, and each key is its own tenant, stored only as a hash."""

from __future__ import annotations

import pytest

from nexrl_service.auth import Authenticator, owner_of
from nexrl_service.errors import Unauthorized


def test_a_configured_key_admits_only_itself() -> None:
    auth = Authenticator("sk-secret", required_prefix="sk-")
    assert auth.check("sk-secret") == owner_of("sk-secret")
    with pytest.raises(Unauthorized, match="does not match"):
        auth.check("sk-other")
    with pytest.raises(Unauthorized, match="does not match"):
        auth.check("sk-secre")


def test_without_a_key_the_prefix_rule_applies_and_keys_are_tenants() -> None:
    auth = Authenticator(None, required_prefix="sk-")
    alice, bob = auth.check("sk-alice"), auth.check("sk-bob")
    assert alice != bob and alice == auth.check("sk-alice")
    assert "alice" not in alice and len(alice) == 32
    with pytest.raises(Unauthorized, match="must start with 'sk-'"):
        auth.check("alice")
    assert Authenticator(None).check("anything") == owner_of("anything")


def test_a_missing_key_names_the_header_and_the_hint() -> None:
    auth = Authenticator(None, header="X-Custom-Key", missing_hint="set MY_KEY")
    for key in (None, ""):
        with pytest.raises(Unauthorized, match="missing X-Custom-Key header; set MY_KEY") as info:
            auth.check(key)
        assert info.value.status_code == 401


def test_anonymous_callers_are_one_tenant_only_without_a_configured_key() -> None:
    from nexrl_service.auth import ANONYMOUS_OWNER

    open_door = Authenticator(None, allow_anonymous=True)
    assert open_door.check(None) == open_door.check("") == ANONYMOUS_OWNER
    assert open_door.check("sk-alice") == owner_of("sk-alice") != ANONYMOUS_OWNER
    with pytest.raises(Unauthorized, match="missing"):
        Authenticator("sk-secret", allow_anonymous=True).check(None)
