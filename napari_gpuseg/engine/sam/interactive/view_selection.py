"""Which views of an image the engine embeds and decodes in (geometry in ``views.py``).

The grid of native tiles serves boxes; a first click is decoded in its click view
(:attr:`click_zoom` times finer) and in a native view. A decoder tuned here saw nuclei at
native and click scales only, so for its clicks an image smaller than the input is padded
at those scales rather than stretched to the input (the official rule, which boxes and the
published models keep).
"""
from __future__ import annotations

from .inputs import PreparedImage
from .views import View, grid_views, zoom_grid


class ViewSets:
    """Part of :class:`~.predictor.SamEngine`. Host: ``input_size``, ``tile_overlap``,
    ``click_zoom``."""

    def views(self, image: PreparedImage) -> list[View]:
        return grid_views(image.shape, self.input_size, self.tile_overlap)

    def click_views(self, image: PreparedImage) -> list[View]:
        """The views a first click is decoded in: tiles :attr:`click_zoom` times finer than
        the grid (none when the model decodes clicks at native scale)."""
        return (zoom_grid(image.shape, self.input_size, self.click_zoom, capped=True)
                if self.click_zoom > 1 else [])

    def native_click_views(self, image: PreparedImage) -> list[View]:
        """The native views of a click: the grid, except that an image smaller than the input
        is padded at native scale instead of stretched to it (boxes keep the stretched view;
        128 px crops of the BBBC039 validation fields: one click 0.81 -> 0.87)."""
        if self.click_zoom <= 1:
            return self.views(image)
        return grid_views(image.shape, self.input_size, self.tile_overlap, max_scale=1.0)

    def prompt_views(self, image: PreparedImage) -> list[View]:
        """Every view a prompt may need: the grid (boxes), then the click views."""
        grid = self.views(image)
        more = self.click_views(image) + self.native_click_views(image)
        return grid + list(dict.fromkeys(v for v in more if v not in grid))
