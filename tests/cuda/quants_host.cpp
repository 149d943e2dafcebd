// Host check of vendor/ggml/cuda/lucepy-quants.cuh (tests/test_cuda_kernels.py): reads on stdin
// int32 kind, rows, pieces per row; the rows' quant blocks; per piece 32 int8 activations; per
// piece (dx, sx) as two floats. Writes on stdout, per row and piece, the piece's dot product.
#include "lucepy-quants.cuh"

#include <cstdio>
#include <vector>

using namespace lucepy;

template <int K> static float piece_dot(const uint8_t * row, int piece, const int8_t * xq,
                                        const float * ds) {
    const uint8_t * block = row + (piece / Layout<K>::pieces) * Layout<K>::bytes;
    Piece p;
    unpack<K>(block, piece % Layout<K>::pieces, p);
    int x[8];
    memcpy(x, xq + 32 * piece, 32);
    return dot(p, x, ds[2 * piece], ds[2 * piece + 1]);
}

static int row_bytes(int kind, int pieces) {
    return with_kind(kind, [&](auto k) {
        using L = Layout<decltype(k)::value>;
        return pieces / L::pieces * L::bytes;
    });
}

int main() {
    int head[3];
    if (fread(head, sizeof(int), 3, stdin) != 3) {
        return 2;
    }
    const int kind = head[0], rows = head[1], pieces = head[2];
    const int rb = row_bytes(kind, pieces);
    std::vector<uint8_t> w(size_t(rows) * rb);
    std::vector<int8_t> xq(size_t(pieces) * 32);
    std::vector<float> ds(size_t(pieces) * 2);
    if (fread(w.data(), 1, w.size(), stdin) != w.size() ||
        fread(xq.data(), 1, xq.size(), stdin) != xq.size() ||
        fread(ds.data(), sizeof(float), ds.size(), stdin) != ds.size()) {
        return 2;
    }
    std::vector<float> out;
    for (int r = 0; r < rows; r++) {
        const uint8_t * row = w.data() + size_t(r) * rb;
        for (int p = 0; p < pieces; p++) {
            out.push_back(with_kind(kind, [&](auto k) {
                return piece_dot<decltype(k)::value>(row, p, xq.data(), ds.data());
            }));
        }
    }
    fwrite(out.data(), sizeof(float), out.size(), stdout);
    return 0;
}
