"""Worker processes for layout (c): one pipeline per worker under
MultiWorkerMirroredStrategy (started by `kh.testing.run_workers`)."""


def replicated_pipeline_mwms(shares, microbatches, epochs=2):
    """Each worker one replica whose two layers run on its two local CPUs."""
    import keras_hetero as kh
    from tests.support import helpers

    devices = kh.testing.logical_cpus(2)
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    reference = kh.keras.Model(*helpers.layers(regularizer=True))
    names = [layer.name for layer in reference.layers[1:]]
    pair = [(devices[0], 1.0), (devices[1], 1.0)]
    choice = kh.placement.plan_layout(
        reference,
        [pair, pair],
        batch_size=helpers.GLOBAL_BATCH,
        microbatches=microbatches,
        layer_costs=dict(zip(names, [1.0, 1.0])),
    )
    layout = choice.layouts["replicated pipelines"]
    with strategy.scope():
        model = kh.placement.LayoutChoice(
            layouts=choice.layouts, best=layout, cluster=choice.cluster
        ).apply(reference)
        helpers.compile_model(model)
        model.set_weights(helpers.initial_weights(regularizer=True))
    data = kh.data.shard(
        helpers.examples(sample_weights=True),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=shares,
    )
    history = model.fit(data, epochs=epochs, verbose=0)
    placed = [
        layer.device
        for layer in model.layers
        if isinstance(layer, kh.layers.Placed)
    ]
    return {
        "weights": model.get_weights(),
        "loss": history.history["loss"],
        "devices": placed,
        "num_replicas": strategy.num_replicas_in_sync,
        "layout_shares": layout.shares,
    }
