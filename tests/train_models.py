"""Tiny model files for the training tests: one per task, fast on a CPU."""

CLASSIFIER = """
model tiny_classifier {
    input x: f32[N, 1, 8, 8]
    target y: i64[N]
    conv1 = conv2d(x, out_channels=8, kernel_size=3, padding=1, bias=false)
    bn1 = batchnorm2d(conv1)
    r1 = relu(bn1)
    drop = dropout(r1, p=0.2)
    pool = adaptive_avgpool2d(drop, output_size=2)
    flat = flatten(pool)
    fc = linear(flat, out_features=10)
    loss = cross_entropy(fc, y)
    return loss, fc
}
"""

DENOISER = """
model tiny_denoiser {
    input x: f32[N, 1, 16, 16]
    target y: f32[N, 1, 16, 16]
    conv1 = conv2d(x, out_channels=8, kernel_size=3, padding=1)
    r1 = relu(conv1)
    conv2 = conv2d(r1, out_channels=1, kernel_size=3, padding=1)
    loss = mse_loss(conv2, y)
    return loss, conv2
}
"""

SEGMENTER = """
model tiny_segmenter {
    input x: f32[N, 9, 16, 16]
    target y: f32[N, 1, 16, 16]
    conv1 = conv2d(x, out_channels=8, kernel_size=3, padding=1)
    r1 = relu(conv1)
    conv2 = conv2d(r1, out_channels=1, kernel_size=1)
    prob = sigmoid(conv2)
    loss = bce_loss(prob, y)
    return loss, prob
}
"""

AUTOENCODER = """
model tiny_autoencoder {
    input x: f32[N, 1, 16, 16]
    conv1 = conv2d(x, out_channels=8, kernel_size=3, padding=1)
    r1 = relu(conv1)
    pool = maxpool2d(r1, kernel_size=2)
    up = upsample(pool, scale_factor=2)
    conv2 = conv2d(up, out_channels=1, kernel_size=3, padding=1)
    loss = mse_loss(conv2, x)
    return loss, conv2
}
"""
