"""The `kvpark` module is the public surface: what README's API section uses imports from it."""

from __future__ import annotations

import kvpark
import kvpark.client


def test_the_timeout_sentinel_imports_from_kvpark() -> None:
    from kvpark import USE_CLIENT_DEFAULT

    assert USE_CLIENT_DEFAULT is kvpark.client.USE_CLIENT_DEFAULT
    assert "USE_CLIENT_DEFAULT" in kvpark.__all__
