"""A request's tenant and priority class from what the router can believe: the API key, the settings, and headers
only from a trusted hop (router/tenancy.py)."""

import hashlib
import json

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from warmroute.core.routing_key import key_for_json
from warmroute.errors import UsageError
from warmroute.router.errors import ApiError
from warmroute.router.settings_load import load_settings
from warmroute.router.tenancy import ANONYMOUS, Tenancy


def _tenancy(**kw) -> Tenancy:
    return Tenancy(load_settings({"backends": ["http://127.0.0.1:1"], **kw}, env={}))


def _headers(**h) -> CIMultiDictProxy:
    return CIMultiDictProxy(CIMultiDict({k.replace("_", "-"): v for k, v in h.items()}))


KEY = key_for_json("/v1/chat/completions", {"model": "big", "user": "alice",
                                              "messages": [{"role": "user", "content": "hi"}]})


def test_the_tenant_comes_from_the_api_key_unless_a_trusted_hop_names_it():
    t = _tenancy()
    assert t.tenant_of(_headers(x_tenant="acme", Authorization="Bearer sk-1"), KEY) == t.key_tenant("sk-1")
    assert t.tenant_of(_headers(x_tenant="acme"), KEY) == ANONYMOUS  # a client's own claim counts for nothing
    hashed = t.tenant_of(_headers(Authorization="Bearer sk-secret"), KEY)
    assert hashed.startswith("key-") and len(hashed) == 16 and "secret" not in hashed  # never the key itself
    assert hashed == t.tenant_of(_headers(Authorization="bearer sk-secret"), KEY)
    assert hashed != "key-" + hashlib.sha256(b"sk-secret").hexdigest()[:12]  # salted: not a dictionary lookup
    salted = _tenancy(api_key_salt="s1")
    again, other = _tenancy(api_key_salt="s1"), _tenancy(api_key_salt="s2")
    assert salted.key_tenant("k") == again.key_tenant("k") != other.key_tenant("k")
    trusted = _tenancy(trust_client_headers=True)
    assert trusted.tenant_of(_headers(x_tenant="acme", Authorization="Bearer sk-1"), KEY) == "acme"
    users = _tenancy(tenant_from="user,header", trust_client_headers=True)
    assert users.tenant_of(_headers(x_tenant="acme"), KEY) == "alice"
    assert users.tenant_of(_headers(x_tenant="acme", x_session_id="s1"), KEY) == "acme"  # session: not the user
    assert _tenancy(tenant_header="x-team", trust_client_headers=True).tenant_of(_headers(x_team="t9"), KEY) == "t9"


def test_api_keys_map_key_hashes_to_tenants_and_unknown_keys_to_anonymous():
    digest = hashlib.sha256(b"sk-acme").hexdigest()
    t = _tenancy(api_keys=f"sha256:{digest.upper()}=acme")
    assert t.tenant_of(_headers(Authorization="Bearer sk-acme"), KEY) == "acme"
    assert t.tenant_of(_headers(Authorization="Bearer sk-invented"), KEY) == ANONYMOUS
    with pytest.raises(UsageError) as exc:
        _tenancy(api_keys="sk-acme=acme")  # the key itself, not its hash
    assert "api_keys" in str(exc.value) and "sha256" in str(exc.value) and "sk-acme" not in str(exc.value)


def test_a_priority_is_a_declared_class_never_above_the_tenants_maximum():
    t = _tenancy(tenant_priorities="acme=5", model_priorities="big=-3")
    assert t.classes.values == [-3, 0, 5]
    assert t.priority_of(_headers(x_priority="1000"), "acme", KEY) == 5  # untrusted: the header is ignored
    assert t.priority_of(_headers(), "acme", KEY) == 5
    assert t.priority_of(_headers(), "other", KEY) == -3
    assert t.priority_of(_headers(), "other", None) == 0
    c = _tenancy(trust_client_headers=True, priority_classes="batch=-10,standard=0,critical=100",
                 tenant_max_priorities="ops=100,web=50")
    assert c.priority_of(_headers(x_priority="1000"), "anyone", KEY) == 0  # clamped to its default
    assert c.priority_of(_headers(x_priority="batch"), "anyone", KEY) == -10  # lowering oneself is allowed
    assert c.priority_of(_headers(x_priority="-7"), "anyone", KEY) == -10  # the nearest class
    assert c.priority_of(_headers(x_priority="critical"), "ops", KEY) == 100
    assert c.priority_of(_headers(x_priority="1000"), "web", KEY) == 0  # the highest class within its maximum
    assert c.label(100) == "critical" and c.label(7) == "other"
    for bad in ("high", "1001", "1.5", ""):
        with pytest.raises(ApiError) as exc:
            c.priority_of(_headers(x_priority=bad), "", KEY)
        assert exc.value.status == 400 and "x-priority" in exc.value.message
    assert _tenancy(priority_classes="0,10,20").classes.values == [0, 10, 20]


def test_bad_tenancy_settings_are_refused_naming_the_setting():
    for kw in ({"tenant_from": "header,cookie"}, {"tenant_weights": "a=0"}, {"model_priorities": "m"},
               {"tenant_from": "header"}, {"tenant_from": "user,api_key"}, {"priority_classes": "a=1,b=1"},
               {"priority_classes": ",".join(str(i) for i in range(17))}, {"tenant_max_priorities": "a=2000"}):
        with pytest.raises(UsageError) as exc:
            _tenancy(**kw)
        assert next(iter(kw)) in str(exc.value)
    assert json.dumps(_tenancy(tenant_weights="a=2").settings.admission.tenant_weights) == '{"a": 2.0}'
