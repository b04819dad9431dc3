"""``kvdex bench``: decode speed, memory and transfer of kvdex policies vs transformers' caches.

``shapes`` builds random-weight models of named shapes, ``config`` says what to measure, ``decoding``
builds a method's cache and runs prefill and decode steps, ``checks`` proves the methods correct
before timing, ``timing`` times decode steps, ``runner`` measures the whole grid, ``report`` prints /
writes JSON / plots, ``cli`` holds the arguments (registered by ``kvdex.cli``).
"""
