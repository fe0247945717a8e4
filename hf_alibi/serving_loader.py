"""How `hf-alibi serve` loads its model: through `AutoModelForCausalLM`, which finds the classes `import hf_alibi`
registers with the Auto classes. transformers' server loads `getattr(transformers, config.architectures[0])`, a class
transformers itself defines, which `AlibiGPT2LMHeadModel` is not; everything but that one call is transformers' own
loading (the processor, the device, dtype and attention settings and their checks).

transformers 5.24 loads in the server's process, through its `ModelManager` (`AutoLoadingModelManager`); 5.25 in a
process the server spawns, which unpickles a copy of the server's `ModelLoader` (`AutoModelLoader`). Pickle finds a
class by its module and name, so each is defined at the top of this module, the one the installed release uses.
Imported by `serving.build_app` only: transformers' serving modules import fastapi (the `serve` extra).
"""

from transformers import AutoModelForCausalLM

from ._transformers_compat import (
    serving_loading_error,
    serving_model_id_parts,
    serving_model_in_own_process,
    serving_model_loader_class,
    serving_model_manager_class,
)


def load_causal_lm(model_id: str, settings, model_kwargs: dict, **loading):
    """The model `model_id` ('repo@revision' or a folder) through `AutoModelForCausalLM`, with the keyword arguments
    transformers' server gives `from_pretrained` (device, dtype, attention, trust_remote_code, from `settings`: its
    model manager or loader), `loading` (5.24's `tqdm_class`) and `model_kwargs` (`alibi_skip_eps`) on top."""
    repo, revision = serving_model_id_parts(model_id)
    return AutoModelForCausalLM.from_pretrained(
        repo,
        revision=revision,
        attn_implementation=settings.attn_implementation,
        dtype=settings.dtype,
        device_map=settings.device,
        trust_remote_code=settings.trust_remote_code,
        **loading,
        **model_kwargs,
    )


if serving_model_in_own_process():

    class AutoModelLoader(serving_model_loader_class()):
        """transformers' `ModelLoader` (written against 5.25), loading the model with `load_causal_lm`.

        It overrides the public `load_model_and_processor`, which the model's process calls: the processor as
        transformers loads it (`load_processor`), then the model. The progress events that method may send (to
        `/load_model`, for a model loaded while the server runs) are not sent: `hf-alibi serve` loads its one model
        at start. Drop this class when transformers' loader loads through the Auto classes.
        """

        def __init__(self, *, model_kwargs: dict, **kwargs):
            super().__init__(**kwargs)
            self.model_kwargs = dict(model_kwargs)

        def load_model_and_processor(self, model_id: str, on_progress=None):
            processor = self.load_processor(model_id)
            return load_causal_lm(model_id, self, self.model_kwargs), processor

else:

    class AutoLoadingModelManager(serving_model_manager_class()):
        """transformers' `ModelManager` (written against 5.24), loading every model with `load_causal_lm`.

        5.24 has no public loading hook: this overrides the private `_load_model(model_id_and_revision, tqdm_class,
        progress_callback, gguf_file)`, which ends in `getattr(transformers, config.architectures[0])`. Drop this
        class when transformers' model manager loads through the Auto classes.
        """

        def __init__(self, *, model_kwargs: dict, **kwargs):
            self.model_kwargs = dict(model_kwargs)  # before super().__init__, which loads force_model
            super().__init__(**kwargs)

        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            return load_causal_lm(model_id_and_revision, self, self.model_kwargs, tqdm_class=tqdm_class)


def pinned_model_manager(model: str, settings: dict, model_kwargs: dict, generation_state):
    """transformers' model manager serving `model` alone, loaded now through `AutoModelForCausalLM` with
    `model_kwargs` on top; `settings` are its device, dtype, attn_implementation and continuous_batching. 5.24: the
    model is in this process; 5.25+: in the process the manager starts, which runs `generation_state`'s settings."""
    if serving_model_in_own_process():
        loader = AutoModelLoader(model_kwargs=model_kwargs, **settings)
        try:
            return serving_model_manager_class()(loader, generation_state, force_model=model)
        except RuntimeError as error:  # a loading error, sent from the model's process as text
            raise serving_loading_error(error) from None
    return AutoLoadingModelManager(model_kwargs=model_kwargs, force_model=model, **settings)


__all__ = ["load_causal_lm", "pinned_model_manager"]
