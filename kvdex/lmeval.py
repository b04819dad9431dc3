"""``python -m kvdex.lmeval ARGS``: lm-evaluation-harness's command line with the ``kvdex`` model registered.

    python -m kvdex.lmeval --model kvdex --model_args pretrained=smollm2,policy=quest,budget=256 --tasks ...

``import kvdex.lmeval`` registers the model for ``lm_eval.simple_evaluate(model="kvdex", ...)``.
The model is :class:`kvdex.hf.lmeval.KVDexLM` (needs ``pip install "kvdex[lmeval]"``).
"""

from kvdex.hf.lmeval import KVDexLM, main

__all__ = ["KVDexLM", "main"]

if __name__ == "__main__":
    main()
