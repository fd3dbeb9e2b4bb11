"""The native DeepSeek-V4 engine. Offline use: `from engine import LLM`; serving: `AsyncLLM`.

Both are imported on first use, so light modules (`engine.request`, `engine.args`) load without torch's
start-up cost for callers that need only those."""

__all__ = ["LLM", "AsyncLLM"]


def __getattr__(name: str):
    if name in __all__:
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
