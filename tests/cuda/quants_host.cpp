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
    switch (kind) {
        case Q4_0: return pieces * Layout<Q4_0>::bytes;
        case Q8_0: return pieces * Layout<Q8_0>::bytes;
        case Q4_K: return pieces / 8 * Layout<Q4_K>::bytes;
        case Q4_1: return pieces * Layout<Q4_1>::bytes;
        case Q5_1: return pieces * Layout<Q5_1>::bytes;
        case Q5_K: return pieces / 8 * Layout<Q5_K>::bytes;
        case IQ4_XS: return pieces / 8 * Layout<IQ4_XS>::bytes;
        default: return pieces / 8 * Layout<Q6_K>::bytes;
    }
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
            switch (kind) {
                case Q4_0: out.push_back(piece_dot<Q4_0>(row, p, xq.data(), ds.data())); break;
                case Q8_0: out.push_back(piece_dot<Q8_0>(row, p, xq.data(), ds.data())); break;
                case Q4_K: out.push_back(piece_dot<Q4_K>(row, p, xq.data(), ds.data())); break;
                case Q4_1: out.push_back(piece_dot<Q4_1>(row, p, xq.data(), ds.data())); break;
                case Q5_1: out.push_back(piece_dot<Q5_1>(row, p, xq.data(), ds.data())); break;
                case Q5_K: out.push_back(piece_dot<Q5_K>(row, p, xq.data(), ds.data())); break;
                case IQ4_XS:
                    out.push_back(piece_dot<IQ4_XS>(row, p, xq.data(), ds.data()));
                    break;
                default: out.push_back(piece_dot<Q6_K>(row, p, xq.data(), ds.data())); break;
            }
        }
    }
    fwrite(out.data(), sizeof(float), out.size(), stdout);
    return 0;
}
