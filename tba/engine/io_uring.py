"""Placeholder until the native engine lands: reports that it is not built."""


def probe() -> str | None:
    return "the native io_uring engine is not built in this version"
