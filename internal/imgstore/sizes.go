package imgstore

// LayerSizes is the bytes of regular files in each of t's layers, in the
// order of t.Layers (0 where a layer's record cannot be read): what the
// dashboard's templates page shows of a template's layers.
func (s *Store) LayerSizes(t *Template) []int64 {
	out := make([]int64, len(t.Layers))
	for i, d := range t.Layers {
		hx, err := digestHex(d)
		if err != nil {
			continue
		}
		if info, err := s.readLayerInfo(hx); err == nil {
			out[i] = info.Size
		}
	}
	return out
}
