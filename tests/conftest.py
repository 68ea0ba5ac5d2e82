"""Every ``@pytest.mark.asyncio`` test runs on both event loops pipeload supports."""

import asyncio

import uvloop


def pytest_asyncio_loop_factories(config, item):
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
