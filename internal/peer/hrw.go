package peer

import (
	"hash/fnv"
	"strconv"

	"github.com/opencontainers/go-digest"
)

// StripeSize is the span of compressed blob bytes owned by one member. 4 MiB
// is a few frames at the default 2 MiB chunk size: a foreground miss with
// its 1 MiB read-ahead touches one stripe (two at a boundary), an 8 MiB
// fill batch two or three.
const StripeSize = 4 << 20

// StripeKey is the rendezvous key of the stripe holding blob offset off.
func StripeKey(layer digest.Digest, off int64) string {
	return layer.String() + "/" + strconv.FormatInt(off/StripeSize, 10)
}

// Owner returns the member with the highest rendezvous weight for key, or
// "" when members is empty. The result depends only on key and the set of
// members, not their order.
func Owner(key string, members []string) string {
	var (
		best  string
		bestW uint64
	)
	for _, m := range members {
		w := weight(m, key)
		if best == "" || w > bestW || (w == bestW && m < best) {
			best, bestW = m, w
		}
	}
	return best
}

// weight hashes member and key together. FNV-1a alone mixes the last bytes
// poorly (members differing only in their last octet would rank almost
// alike), so its output goes through the splitmix64 finalizer.
func weight(member, key string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(member))
	h.Write([]byte{0})
	h.Write([]byte(key))
	return mix(h.Sum64())
}

func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
