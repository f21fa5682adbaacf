"""Tiny model files for the tests: one per training task, fast on a CPU, and models the
compression checks share."""

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

# Batch norms after ReLUs on noise-like maps: DCT's round trip (about 0.87 here) gives a
# batch norm's weight and the bias before it gradient errors of 1 or more.
BN_CANCEL = """
model cancel {
    input x: f32[N, 2, 16, 16]
    target y: f32[N, 4, 16, 16]
    c1 = conv2d(x, out_channels=4, kernel_size=3, padding=1)
    r1 = relu(c1)
    b1 = batchnorm2d(r1)
    c2 = conv2d(b1, out_channels=4, kernel_size=3, padding=1)
    r2 = relu(c2)
    b2 = batchnorm2d(r2)
    c3 = conv2d(b2, out_channels=4, kernel_size=1)
    loss = mse_loss(c3, y)
    return loss, c3
}
"""
