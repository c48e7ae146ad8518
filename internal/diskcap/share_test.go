package diskcap

import "testing"

func TestShare(t *testing.T) {
	const gi = 1 << 30
	for _, tc := range []struct {
		name              string
		want, size, avail int64
		reserve           int
		share             int64
		fails             bool
	}{
		{"room for the cap", 20 * gi, 250 * gi, 76 * gi, 10, 20 * gi, false},
		{"cap above the free space", 20 * gi, 100 * gi, 15 * gi, 10, 5 * gi, false},
		{"exactly the room", 5 * gi, 100 * gi, 15 * gi, 10, 5 * gi, false},
		{"no reserve", 20 * gi, 100 * gi, 15 * gi, 0, 15 * gi, false},
		{"only the reserve free", 20 * gi, 100 * gi, 10 * gi, 10, 0, true},
		{"less than MinBytes beyond the reserve", 20 * gi, 100 * gi, 10*gi + MinBytes - 1, 10, 0, true},
		{"MinBytes beyond the reserve", 20 * gi, 100 * gi, 10*gi + MinBytes, 10, MinBytes, false},
	} {
		got, err := Share(tc.want, tc.size, tc.avail, tc.reserve)
		if (err != nil) != tc.fails || got != tc.share {
			t.Errorf("%s: Share = %d, %v; want %d, error %v", tc.name, got, err, tc.share, tc.fails)
		}
	}
}
