"""A request's tenant and priority from its headers, body and the settings (router/tenancy.py)."""

import json

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from warmroute.core.routing_key import key_for_json
from warmroute.router.errors import ApiError
from warmroute.router.settings import load_settings
from warmroute.router.tenancy import priority_of, tenant_of


def _settings(**kw):
    return load_settings({"backends": ["http://127.0.0.1:1"], **kw}, env={})


def _headers(**h) -> CIMultiDictProxy:
    return CIMultiDictProxy(CIMultiDict({k.replace("_", "-"): v for k, v in h.items()}))


KEY = key_for_json("/v1/chat/completions", {"model": "big", "user": "alice",
                                              "messages": [{"role": "user", "content": "hi"}]})


def test_the_tenant_comes_from_the_first_source_found():
    s = _settings()  # header, then api_key
    assert tenant_of(_headers(x_tenant="acme", Authorization="Bearer sk-1"), KEY, s) == "acme"
    hashed = tenant_of(_headers(Authorization="Bearer sk-secret"), KEY, s)
    assert hashed.startswith("key-") and len(hashed) == 16 and "secret" not in hashed  # never the key itself
    assert hashed == tenant_of(_headers(Authorization="bearer sk-secret"), KEY, s)
    assert tenant_of(_headers(), KEY, s) == ""  # the user field is not a source by default
    users = _settings(tenant_from="user,header")
    assert tenant_of(_headers(x_tenant="acme"), KEY, users) == "alice"
    assert tenant_of(_headers(x_tenant="acme", x_session_id="s1"), KEY, users) == "acme"  # session: not the user
    assert tenant_of(_headers(x_team="t9"), KEY, _settings(tenant_header="x-team")) == "t9"


def test_the_priority_comes_from_the_header_then_the_tenant_then_the_model():
    s = _settings(tenant_priorities="acme=5", model_priorities="big=-3")
    assert priority_of(_headers(x_priority="7"), "acme", KEY, s) == 7
    assert priority_of(_headers(), "acme", KEY, s) == 5
    assert priority_of(_headers(), "other", KEY, s) == -3
    assert priority_of(_headers(), "other", None, s) == 0
    for bad in ("high", "1001", "1.5", ""):
        with pytest.raises(ApiError) as exc:
            priority_of(_headers(x_priority=bad), "", KEY, s)
        assert exc.value.status == 400 and "x-priority" in exc.value.message


def test_bad_tenancy_settings_are_refused_naming_the_setting():
    from warmroute.errors import UsageError

    for kw in ({"tenant_from": "header,cookie"}, {"tenant_weights": "a=0"}, {"model_priorities": "m"}):
        with pytest.raises(UsageError) as exc:
            _settings(**kw)
        assert next(iter(kw)) in str(exc.value)
    assert json.dumps(_settings(tenant_weights="a=2").tenant_weights) == '{"a": 2.0}'
