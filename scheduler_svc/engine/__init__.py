"""The engine loop: one engine per executor, the lanes that step them, routing, and the
asyncio front over them all."""
