"""``kvdex bench``: decode speed, memory and transfer of kvdex policies vs transformers' caches.

``shapes`` builds random-weight models of named shapes, ``runner`` measures, ``report`` prints /
writes JSON / plots, ``cli`` holds the arguments (registered by ``kvdex.cli``).
"""
