"""Interactive annotation without a window: :class:`~.session.AnnotationSession` (exported as
``napari_gpuseg.engine.AnnotationSession``) owns an image, its embeddings, the current
object's prompt and mask, the label image and the work it schedules on an
:class:`~napari_gpuseg.engine.runtime.worker.InferenceWorker`. The SAM annotator dock is a
view over one."""
