"""napari_gpuseg.engine: every public name resolves, is documented and is listed in the
module docstring."""
import napari_gpuseg.engine as api


def test_every_public_name_resolves_with_a_docstring():
    assert api.__all__ == sorted(api.__all__) and len(api.__all__) >= 15
    for name in api.__all__:
        obj = getattr(api, name)
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
        assert f"``{name}" in api.__doc__, f"{name} is not described in the module docstring"
    assert set(api.__all__) <= set(dir(api))


def test_public_names_are_the_engine_objects():
    from napari_gpuseg.engine.runtime.allocator import configure_allocator
    from napari_gpuseg.engine.runtime.cancel import CancelToken
    from napari_gpuseg.engine.sam.interactive.predictor import SamEngine
    from napari_gpuseg.engine.unet.unet_checkpoint import load_unet

    assert api.CancelToken is CancelToken and api.SamEngine is SamEngine and api.load_unet is load_unet
    assert api.configure_allocator is configure_allocator


def test_unknown_name_is_an_attribute_error():
    try:
        api.no_such_function
    except AttributeError as exc:
        assert "no_such_function" in str(exc)
    else:
        raise AssertionError("expected AttributeError")
